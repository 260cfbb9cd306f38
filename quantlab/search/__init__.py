"""+search=cheapest: the cheapest per-layer quantization that passes the gate, proven on the exported checkpoint
(quantlab.search.driver has the whole story; frontier, checks, sensitivity, candidates and latency its parts).
Nothing is imported here."""
