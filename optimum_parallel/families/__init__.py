"""Model-family parallelizers, registered with optimum_parallel through the entry-point group
`optimum_parallel.parallelizers` (see pyproject.toml). Each module is a small plan plus hooks."""
