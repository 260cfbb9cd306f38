"""Reports for reviewers: metrics.json / junit.xml (documents), report.md / report.html (render), the sweep summary
(sweep), and plots."""
