"""Which implementation runs, why, and that CPU hosts never import the Neuron code."""

import logging
import sys

import pytest
from qwen3_titan_nki_moe import constraints, registry
from qwen3_titan_nki_moe.ops import grouped_swiglu as grouped_swiglu_ops

BUILTIN = ["grouped_swiglu", "rope_hf", "rms_norm"]


@pytest.fixture
def no_forced_device(monkeypatch):
    monkeypatch.delenv("QWEN3_TITAN_DEVICE", raising=False)
    monkeypatch.delenv(registry.KERNELS_ENV, raising=False)


def _shape(**changes):
    base = dict(
        seq_len=256,
        head_dim=64,
        hidden_size=256,
        rope_cache_len=2048,
        lnc=2,
        num_experts=8,
        moe_intermediate_size=256,
    )
    return constraints.KernelShape(**{**base, **changes})


def test_logs_one_line_per_op_with_the_reason(no_forced_device, caplog):
    with caplog.at_level(logging.INFO):
        chosen = registry.configure()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[kernels]")]
    assert len(lines) == len(registry.registered())
    assert "[kernels] rope_hf: reference (no Neuron device)" in lines
    assert "[kernels] rms_norm: reference (no Neuron device)" in lines
    grouped = next(line for line in lines if line.startswith("[kernels] grouped_swiglu: "))
    assert grouped.startswith(
        "[kernels] grouped_swiglu: reference (no Neuron device; grouped GEMM: torch._grouped_mm"
    )
    assert {op: c.implementation for op, c in chosen.items() if op in BUILTIN} == dict.fromkeys(
        BUILTIN, "reference"
    )


def test_forced_cpu_is_the_logged_reason(monkeypatch):
    monkeypatch.setenv("QWEN3_TITAN_DEVICE", "cpu")
    assert registry.configure(log=False)["rope_hf"].reason == "QWEN3_TITAN_DEVICE=cpu"


def test_reference_mode_is_the_logged_reason(no_forced_device, monkeypatch):
    assert registry.configure("reference", log=False)["rms_norm"].reason == "--kernels reference"
    monkeypatch.setenv(registry.KERNELS_ENV, "reference")
    assert registry.configure(None, log=False)["rms_norm"].reason == "QWEN3_TITAN_KERNELS=reference"


def test_get_hands_out_the_reference_ops_off_neuron(no_forced_device):
    import torch

    assert registry.get("rope_hf") is torch.ops.qwen3_titan.rope_hf
    assert registry.get("grouped_swiglu") is grouped_swiglu_ops.reference
    with pytest.raises(KeyError, match="not registered"):
        registry.get("no_such_op")


def test_the_neuron_code_is_never_imported_off_neuron(no_forced_device):
    import torch

    registry.configure()
    x = torch.randn(4, 8)
    registry.get("rms_norm")(x, torch.ones(8), 1e-6)
    neuron_modules = [
        m
        for m in sys.modules
        if m.startswith("qwen3_titan_nki_moe.nki") or m.split(".")[0] in ("nki", "torch_neuronx")
    ]
    assert neuron_modules == []


def test_nki_mode_without_a_neuron_device_is_one_line(no_forced_device):
    with pytest.raises(registry.KernelSelectionError) as err:
        registry.configure("nki", _shape())
    message = str(err.value)
    assert "\n" not in message
    assert (
        message.startswith("--kernels nki: no Neuron device;")
        and "use --kernels auto or reference" in message
    )


def test_nki_mode_checks_the_shape_rules_first_on_any_device(no_forced_device):
    with pytest.raises(constraints.KernelConstraintError, match=r"^--training.seq_len 1000: "):
        registry.configure("nki", _shape(seq_len=1000))


def test_auto_on_neuron_falls_back_per_op_when_a_rule_breaks(no_forced_device):
    # Every op breaks a rule, so no NKI module is imported (none can be on this host).
    chosen = registry.configure(
        "auto", _shape(seq_len=1000, moe_intermediate_size=200), device_kind="neuron", log=False
    )
    for op in BUILTIN:
        assert chosen[op].implementation == "reference"
        assert chosen[op].reason.startswith("auto: --") or chosen[op].reason.startswith("auto: config.json")
    assert "needs a multiple of 256" in chosen["rope_hf"].reason


def test_mode_comes_from_the_flag_then_the_environment(monkeypatch):
    monkeypatch.setenv(registry.KERNELS_ENV, "reference")
    assert registry.requested_mode(None) == "reference"
    assert registry.requested_mode("auto") == "reference"
    assert registry.requested_mode("nki") == "nki"
    monkeypatch.setenv(registry.KERNELS_ENV, "fast")
    with pytest.raises(
        registry.KernelSelectionError,
        match="QWEN3_TITAN_KERNELS='fast': expected one of auto, reference, nki",
    ):
        registry.requested_mode(None)


def test_user_ops_join_the_registry(no_forced_device, caplog):
    import torch

    def my_op(x):
        return x

    registry.configure("reference", log=False)
    registry.register("test_identity", reference=my_op, nki="not_installed_pkg.mod:fn")
    try:
        # Registered after configure(): chosen under the same settings.
        assert registry.choices()["test_identity"].reason == "--kernels reference"
        registry.reset()
        with caplog.at_level(logging.INFO):
            assert registry.get("test_identity") is my_op
        assert "[kernels] test_identity: reference (no Neuron device)" in caplog.text
        assert torch.equal(registry.get("test_identity")(torch.ones(2)), torch.ones(2))
    finally:
        registry._OPS.pop("test_identity")
    with pytest.raises(ValueError, match="expected 'package.module:attribute'"):
        registry.register("bad", reference=my_op, nki="no_colon")
