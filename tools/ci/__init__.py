"""Per-package CI: every workspace package installs and tests on its own, and the workspace as a whole.

Run from the repository root::

    uv run python -m tools.ci                          # every package, root tests and ruff
    uv run --no-project python -m tools.ci --package native-backend   # one package (its GitHub job)
    uv run python -m tools.ci --root-only              # root tests and ruff only (the workspace job)
    uv run python -m tools.ci --skip-root -m "not slow"    # -k/-m, and anything after --, go to pytest
    uv run python -m tools.ci --self-check             # drops a dependency in a scratch copy; shows the failure
    uv run python -m tools.ci --write-workflows        # (re)writes .github/workflows/ from packages/*

Each ``packages/*/pyproject.toml`` is one package (found afresh on every run). For each:

1. ``UV_PROJECT_ENVIRONMENT=.ci-envs/<name> uv sync --locked --package <name> --group <each of its groups>``:
   the package, what it declares and its own dependency groups (pytest comes from its ``test`` group),
   at the versions in uv.lock, and nothing else; exact, so what an earlier run installed and the lock no
   longer needs is removed. The folder is reused between runs; uv hardlinks files from its cache, so an
   environment costs seconds, not a download.
2. An import check: every module under the package's ``src/`` is imported in that environment.
3. ``pytest packages/<name>/tests`` there, with the root pyproject's pytest config (markers,
   ``strict_markers``, ``-ra``).

In the workspace environment (``uv run --locked --all-packages``): the root pyproject's other
``testpaths`` (``tests/``, and ``tools/``: the GPU benchmark's CPU-side checks), ``ruff check``,
``ruff format --check``. Two steps run at a time (``--jobs``, see ``lanes``), those with the most slow
tests first. The closing line sums pytest's counts plus one check per import check and ruff command:
``N passed, N failed, N skipped``; the exit status is 1 when anything failed.

Standard library only: the package jobs run it with ``uv run --no-project``, without the workspace.
Modules, one concern each: ``packages`` (discovery, lock graph), ``process`` (running commands),
``environment`` (a package's own environment), ``import_probe`` (the import check's child),
``pytest_run`` (pytest's command and counts), ``results`` (the summary), ``package_run`` and
``workspace_run`` (the kinds of step), ``lanes`` (steps side by side), ``self_check``, ``workflows``, ``cli``.
"""
