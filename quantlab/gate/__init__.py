"""The release gate: metric definitions (metrics), the statistics every threshold is tested with (stats), the
checks and the verdict (checks), and the gate's configuration schema (config). A library the evaluation and the
pipeline call, not a stage. Nothing is imported here: `quantlab.config` imports `quantlab.gate.config` alone."""
