"""Benchmark harness: parallax against its peers on an emulated cluster."""
