"""Reproducible benchmarks of pagellm: offline throughput, online serving, KV-cache memory."""
