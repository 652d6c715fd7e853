"""Helpers for the workspace's tests (importable from every package's tests and the root tests)."""
