"""Benchmark workloads, trace replay and reports."""
