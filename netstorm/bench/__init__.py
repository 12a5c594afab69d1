"""Benchmarks behind ``netstorm bench``; each prints ratios to a baseline measured in the same run."""
