"""quantlab's auxiliary commands: the artifact cache (`python -m quantlab.cache list | prune`) and the sweep summary
rebuilt from run directories (`python -m quantlab.summary DIR ...`). Nothing is imported here."""
