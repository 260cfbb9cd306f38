"""Reports for reviewers: metrics.json / junit.xml (documents), report.md / report.html (render), the sweep summary
(sweep), plots and the per-layer weight error (sqnr)."""
