"""Benchmark workloads: one module or subpackage each, all replayed by `tvcache_bench.replay`."""
