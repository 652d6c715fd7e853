"""examples/my_neuron_kernels: the recipe's bare-module override form, and the module.function form.

torchtitan 0.3.0 rejects ``--override.imports my_neuron_kernels`` ("must be a 'module.function'
path"); the nki-moe backend's trainer expands it into the module's @override factories and keeps
the backend's own kernels for the components the module does not override.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from qwen3_titan_common.perf.train_log import parse_step_lines

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
BACKEND = [
    "qwen3_titan_nki_moe.overrides.grouped_experts",
    "qwen3_titan_nki_moe.overrides.rms_norm",
]


@pytest.fixture
def examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


def _prepared(imports, kernels="auto"):
    from qwen3_titan_nki_moe.config_registry import debug_moe
    from qwen3_titan_nki_moe.trainer import prepare_kernels

    config = debug_moe()
    config.override.imports = imports
    config.kernels = kernels
    chosen = prepare_kernels(config)
    return config, chosen


def _targets(imports):
    return [entry if isinstance(entry, str) else entry[0] for entry in imports]


def test_torchtitan_alone_rejects_the_bare_module(examples_on_path):
    from qwen3_titan_nki_moe.config_registry import debug_moe
    from torchtitan.config.override import OverrideConfig, apply_overrides

    with pytest.raises(ValueError, match="must be a 'module.function' path"):
        apply_overrides(OverrideConfig(imports=["my_neuron_kernels"]), debug_moe())


@pytest.mark.parametrize("entry", ["my_neuron_kernels", "my_neuron_kernels.my_rope_hf"])
def test_both_forms_swap_rope_and_keep_the_backend_kernels(entry, examples_on_path):
    from my_neuron_kernels import MyRoPE
    from torchtitan.config.override import apply_overrides

    config, chosen = _prepared([entry])
    assert _targets(config.override.imports) == ["my_neuron_kernels.my_rope_hf", *BACKEND]
    assert chosen["my_rope_hf"].implementation == "reference"
    lines = apply_overrides(config.override, config)
    assert sum("my_neuron_kernels.my_rope_hf" in line for line in lines) == 2  # one RoPE per layer
    model = config.model_spec.model.build()
    assert sum(isinstance(m, MyRoPE) for m in model.modules()) == 2


def test_the_kernels_flag_reaches_the_users_module(examples_on_path):
    import torch
    from my_neuron_kernels import MyRoPE
    from qwen3_titan_nki_moe import constraints
    from torchtitan.config.override import apply_overrides

    config, chosen = _prepared(["my_neuron_kernels"], kernels="reference")
    apply_overrides(config.override, config)
    ropes = [cfg for _, cfg, _, _ in config.model_spec.model.traverse(MyRoPE.Config)]
    assert len(ropes) == 2
    assert all(
        cfg.kernels == "reference" and cfg.kernel_shape == constraints.kernel_shape(config) for cfg in ropes
    )
    with torch.device("meta"):
        model = config.model_spec.model.build()
    modules = [m for m in model.modules() if isinstance(m, MyRoPE)]
    # The choice the trainer logged, made again by each module when it was built.
    assert [m.kernel for m in modules] == [chosen["my_rope_hf"]] * 2
    assert chosen["my_rope_hf"].line() == "[kernels] my_rope_hf: reference (--kernels reference)"


def test_my_rope_hf_matches_the_backends_reference(examples_on_path):
    import my_neuron_kernels
    import torch

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 16, 32, generator=g, requires_grad=True), torch.randn(2, 2, 16, 32, generator=g)
    angle = torch.randn(1, 16, 16, generator=g).repeat(1, 1, 2)
    args = (q, k, angle.cos(), angle.sin())
    mine, ours = my_neuron_kernels.rope_hf(*args), torch.ops.qwen3_titan.rope_hf(*args)
    assert all(torch.equal(a, b) for a, b in zip(mine, ours, strict=True))
    torch.library.opcheck(torch.ops.my_neuron_kernels.rope_hf, args)
    from qwen3_titan_common.train.tolerance import assert_close_reduction

    grad = torch.randn_like(mine[0])
    # Each entry of q's gradient: two terms, an upstream gradient times a cosine or a sine (at most 1).
    assert_close_reduction(
        torch.autograd.grad(mine[0], q, grad)[0], torch.autograd.grad(ours[0], q, grad)[0], 2,
        2 * grad.abs().max(), name="rope_hf q gradient",
    )  # fmt: skip


@pytest.mark.slow
def test_training_with_the_recipes_override_form(tmp_path):
    env = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "PYTHONPATH": str(EXAMPLES)}
    command = [
        sys.executable, "-m", "qwen3_titan_common.launcher.launch", "--module", "qwen3_titan_nki_moe", "--override.imports", "my_neuron_kernels",
        "--training.steps", "8", "--dump_folder", str(tmp_path / "out"), "--checkpoint.no-enable", "--hf.no-export",
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "[override] --override.imports my_neuron_kernels -> my_neuron_kernels.my_rope_hf" in log
    assert "[kernels] my_rope_hf: reference (QWEN3_TITAN_DEVICE=cpu)" in log
    assert "[Override] my_neuron_kernels.my_rope_hf: model_spec.model.layers.0.attention.rope" in log
    assert "[Override] qwen3_titan_nki_moe.overrides.grouped_experts" in log
    steps = parse_step_lines(log)
    assert len(steps) == 8
    assert steps[-1].loss < steps[0].loss
