"""Repository tools, run as modules from the repository root: ``uv run python -m tools.ci``,
``python -m tools.gpu_bench.bench``, ``uv run python -m tools.bench_suite``.

A package (not loose scripts) so that each tool's pieces import one another by name, with no
``sys.path`` edits; running with ``-m`` from the root puts the root, and so ``tools``, on the path.
Nothing here is imported by the packages under ``packages/``.
"""
