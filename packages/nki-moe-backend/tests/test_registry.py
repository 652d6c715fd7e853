"""Which implementation runs, why, and that CPU hosts never import the Neuron code."""

import importlib
import sys

import pytest
import torch
from nki_moe_models import DEBUG_MOE_SHAPE, kernel_shape
from qwen3_titan_common.runtime.device import DeviceInfo, detect_device
from qwen3_titan_nki_moe import constraints, registry
from qwen3_titan_nki_moe.ops import grouped_swiglu as grouped_swiglu_ops
from qwen3_titan_nki_moe.overrides import RegistryRMSNorm

BUILTIN = ["grouped_swiglu", "rope_hf", "rms_norm"]
NEURON = DeviceInfo("neuron", 64, "neuron", "trn2", "torch_neuronx imported, Neuron device present")
CPU = DeviceInfo("cpu", 1, "gloo", "cpu", "no Neuron or CUDA device found")


@pytest.fixture
def no_forced_device(monkeypatch):
    monkeypatch.delenv("QWEN3_TITAN_DEVICE", raising=False)


@pytest.fixture
def op_table():
    """The registry's op table, restored after the test (tests add and replace ops)."""
    saved = dict(registry._OPS)
    yield
    registry._OPS.clear()
    registry._OPS.update(saved)


@pytest.fixture
def tmp_module(tmp_path, monkeypatch):
    """Writes an importable module (a CPU twin of a kernel module); forgotten after the test."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names = []

    def write(name: str, source: str) -> None:
        (tmp_path / f"{name}.py").write_text(source)
        names.append(name)

    yield write
    for name in names:
        sys.modules.pop(name, None)


def _shape(**changes):
    return kernel_shape(DEBUG_MOE_SHAPE, **changes)


def test_one_line_per_op_with_the_reason(no_forced_device):
    chosen = registry.choose_all("auto")
    lines = [choice.line() for choice in chosen.values()]
    assert list(chosen) == list(registry.registered())
    assert "[kernels] rope_hf: reference (no Neuron device)" in lines
    assert "[kernels] rms_norm: reference (no Neuron device)" in lines
    grouped = next(line for line in lines if line.startswith("[kernels] grouped_swiglu: "))
    assert grouped.startswith(
        "[kernels] grouped_swiglu: reference (no Neuron device; grouped GEMM: F.grouped_mm"
    )
    assert {op: c.implementation for op, c in chosen.items() if op in BUILTIN} == dict.fromkeys(
        BUILTIN, "reference"
    )


def test_forced_cpu_is_the_logged_reason(monkeypatch):
    monkeypatch.setenv("QWEN3_TITAN_DEVICE", "cpu")
    assert registry.choose("rope_hf", "auto").reason == "QWEN3_TITAN_DEVICE=cpu"


def test_reference_mode_is_the_logged_reason():
    assert registry.choose("rms_norm", "reference", device=NEURON).reason == "--kernels reference"


def test_the_reference_implementations_off_neuron():
    assert registry.choose("rope_hf", "auto", device=CPU).fn is torch.ops.qwen3_titan.rope_hf
    assert registry.choose("grouped_swiglu", "auto", device=CPU).fn is grouped_swiglu_ops.reference
    with pytest.raises(KeyError, match="not registered"):
        registry.choose("no_such_op", "auto", device=CPU)


def test_an_unknown_mode_is_one_line():
    with pytest.raises(
        registry.KernelSelectionError, match="^--kernels 'fast': expected one of auto, reference, nki$"
    ):
        registry.choose("rope_hf", "fast", device=CPU)


def test_the_neuron_code_is_never_imported_off_neuron(no_forced_device):
    registry.choose_all("auto", _shape())
    norm = RegistryRMSNorm.Config(normalized_shape=8).build()
    norm(torch.randn(4, 8))
    neuron_modules = [
        m
        for m in sys.modules
        if m.startswith("qwen3_titan_nki_moe.nki") or m.split(".")[0] in ("nki", "torch_neuronx")
    ]
    assert neuron_modules == []


def test_nki_mode_without_a_neuron_device_is_one_line(no_forced_device):
    for choose in (lambda: registry.choose_all("nki", _shape()), lambda: registry.choose("rope_hf", "nki")):
        with pytest.raises(registry.KernelSelectionError) as err:
            choose()
        message = str(err.value)
        assert "\n" not in message
        assert (
            message.startswith("--kernels nki: no Neuron device;")
            and "use --kernels auto or reference" in message
        )


def test_nki_mode_checks_the_shape_rules_first_on_any_device(no_forced_device):
    with pytest.raises(constraints.KernelConstraintError, match=r"^--training.seq_len 1000: "):
        registry.choose_all("nki", _shape(seq_len=1000))
    # One op's choice checks that op's rules.
    with pytest.raises(constraints.KernelConstraintError, match=r"^config.json moe_intermediate_size 200: "):
        registry.choose("grouped_swiglu", "nki", _shape(moe_intermediate_size=200), NEURON)
    with pytest.raises(registry.KernelSelectionError, match="^--kernels nki: no Neuron device"):
        registry.choose("rope_hf", "nki", _shape(moe_intermediate_size=200), CPU)


def test_auto_on_neuron_falls_back_per_op_when_a_rule_breaks():
    # Every op breaks a rule, so no NKI module is imported (none can be on this host).
    chosen = registry.choose_all("auto", _shape(seq_len=1000, moe_intermediate_size=200), NEURON)
    for op in BUILTIN:
        assert chosen[op].implementation == "reference"
        assert chosen[op].reason.startswith("auto: --") or chosen[op].reason.startswith("auto: config.json")
    assert "needs a multiple of 256" in chosen["rope_hf"].reason


def test_the_nki_implementation_is_loaded_on_neuron(op_table, tmp_module):
    # The CPU twin of a kernel module: what registry.choose imports on a Neuron host.
    tmp_module("tmp_twin_kernels", "def twin(x):\n    return x + 1\n")
    registry.register("test_twin", reference=torch.neg, nki="tmp_twin_kernels:twin")
    nki = registry.choose("test_twin", "auto", device=NEURON)
    assert (nki.implementation, nki.reason) == ("nki", "Neuron device present")
    assert nki.fn(torch.ones(1)).item() == 2.0
    registry.register("test_missing", reference=torch.neg, nki="not_installed_pkg.mod:fn")
    fallback = registry.choose("test_missing", "auto", device=NEURON)
    assert fallback.implementation == "reference"
    assert fallback.reason.startswith(
        "auto: loading the NKI kernel failed: No module named 'not_installed_pkg'"
    )
    with pytest.raises(
        registry.KernelSelectionError, match="^--kernels nki: loading the NKI test_missing kernel"
    ):
        registry.choose("test_missing", "nki", device=NEURON)


def test_user_ops_join_the_registry(op_table, no_forced_device):
    def my_op(x):
        return x

    registry.register("test_identity", reference=my_op, nki="not_installed_pkg.mod:fn")
    chosen = registry.choose_all("reference")
    assert chosen["test_identity"].line() == "[kernels] test_identity: reference (--kernels reference)"
    assert chosen["test_identity"].fn is my_op
    with pytest.raises(ValueError, match="expected 'package.module:attribute'"):
        registry.register("bad", reference=my_op, nki="no_colon")


def test_two_modules_with_different_modes_each_run_their_own(op_table, tmp_module, monkeypatch):
    # On a (simulated) Neuron host, rms_norm's NKI side is a CPU twin that records its calls.
    tmp_module(
        "tmp_twin_norm",
        "import torch\n"
        "calls = []\n"
        "def rms_norm(x, weight, eps):\n"
        "    calls.append(x.shape)\n"
        "    return torch.ops.qwen3_titan.rms_norm(x, weight, eps) * 2\n",
    )
    registry.register("rms_norm", reference=torch.ops.qwen3_titan.rms_norm, nki="tmp_twin_norm:rms_norm")
    monkeypatch.setattr(registry, "detect_device", lambda: NEURON)
    tmp_twin_norm = importlib.import_module("tmp_twin_norm")  # written by the fixture, not installed

    nki = RegistryRMSNorm.Config(normalized_shape=8, kernels="nki").build()
    reference = RegistryRMSNorm.Config(normalized_shape=8, kernels="reference").build()
    auto = RegistryRMSNorm.Config(normalized_shape=8).build()  # built last, default mode
    assert [m.kernel.implementation for m in (nki, reference, auto)] == ["nki", "reference", "nki"]

    x = torch.randn(3, 8)
    want = torch.rms_norm(x, (8,), torch.ones(8), 1e-5)  # the Config's default eps; weights start at one
    torch.testing.assert_close(reference(x), want)
    assert tmp_twin_norm.calls == []  # the reference module never touched the twin
    torch.testing.assert_close(nki(x), want * 2)
    assert tmp_twin_norm.calls == [x.shape]
    # The registry keeps no choice: the host going away changes modules built afterwards only.
    monkeypatch.setattr(registry, "detect_device", lambda: CPU)
    later = RegistryRMSNorm.Config(normalized_shape=8).build()
    assert later.kernel.implementation == "reference"
    torch.testing.assert_close(nki(x), want * 2)
    assert len(tmp_twin_norm.calls) == 2


def test_the_host_is_detected_when_no_device_is_given(no_forced_device):
    if detect_device().kind == "neuron":
        pytest.skip("asserts the choice on a host without a Neuron device")
    assert registry.choose("rope_hf", "auto").reason == "no Neuron device"
