"""+search=cheapest: the cheapest per-layer quantization that passes the gate, proven on the exported checkpoint
(quantlab.search.driver has the whole story). Nothing is imported here."""
