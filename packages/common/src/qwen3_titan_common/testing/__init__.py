"""Helpers for tests and benchmarks: tiny real checkpoints, made by transformers itself."""
