"""Benchmarks of rollout-trace (run with `make bench`; not part of the test suite)."""
