"""One-GPU training benchmark of our backends, and the lent GPU's whole session (README.md).

Run as modules from the repository root, our packages on ``PYTHONPATH`` where they are not installed::

    PYTHONPATH=packages/common/src python3 -m tools.gpu_bench.device_check --budget 450
    python -m tools.gpu_bench.bench --tiny

Modules: ``plan`` (the parts and the run shape), ``anchors`` (the anchor run, issue 9's targets, the
flops/token check), ``row`` (one measured row), ``capped`` (processes under a time cap, one deadline),
``environment`` (wheels, the children's environment, the probe), ``titan_rows`` and ``hf_rows`` (running
and reading the two kinds of part), ``report`` (table, targets, output files), ``bench`` (the driver's
command line); the children ``tt_run``, ``hf_moe`` and ``env_probe``; ``trace_summary``; ``compat/``.
"""
