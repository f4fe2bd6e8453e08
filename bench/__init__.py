"""Benchmarks (run from the repository root, e.g. ``python -m bench.bus --quick``)."""
