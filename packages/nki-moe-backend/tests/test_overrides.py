"""The @override factories: what they replace, that checkpoints do not notice, and both import forms."""

import sys
import textwrap

import pytest
import torch
from nki_moe_models import SMALL_MOE, build, model_configs, parse_debug_moe
from qwen3_titan_nki_moe import constraints, override_imports
from qwen3_titan_nki_moe.overrides import (
    KERNEL_OVERRIDES,
    RegistryGroupedExperts,
    RegistryRMSNorm,
    RegistryRoPE,
)
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.common.rope import CosSinRoPE
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

REPLACEMENTS = (RegistryGroupedExperts, RegistryRoPE, RegistryRMSNorm)

# torchtitan's router asks CPU autocast for fp32, which CPU autocast does not do: harmless here.
pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast")


@pytest.mark.parametrize(
    ("cls", "parent"),
    [(RegistryGroupedExperts, GroupedExperts), (RegistryRoPE, CosSinRoPE), (RegistryRMSNorm, RMSNorm)],
)
def test_each_replacement_declares_its_own_config(cls, parent):
    # Without its own nested Config, derive() would silently build the parent.
    assert "Config" in cls.__dict__
    assert cls.Config is not parent.Config and issubclass(cls.Config, parent.Config)
    assert cls.Config._owner is cls


def test_every_target_node_is_replaced_and_built():
    _, overridden, replaced = model_configs()
    layers = SMALL_MOE["num_hidden_layers"]
    # Per layer: experts, rope, q/k norm config, attention_norm, ffn_norm; plus the final norm.
    assert len(replaced) == layers * 5 + 1
    model = build(overridden)
    kinds = {type(m) for m in model.modules()}
    assert {RegistryGroupedExperts, RegistryRoPE, RegistryRMSNorm} <= kinds
    assert not kinds & {GroupedExperts, CosSinRoPE, RMSNorm}


def test_state_dicts_and_hf_keys_are_unchanged():
    stock_cfg, overridden_cfg, _ = model_configs()
    stock, overridden = build(stock_cfg), build(overridden_cfg)
    a, b = stock.state_dict(), overridden.state_dict()
    assert list(a) == list(b)
    assert all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype for k in a)
    assert any(k.endswith("inner_experts.w1_EFD") for k in b)
    adapter = Qwen3StateDictAdapter(overridden_cfg, None)
    hf_a = adapter.to_hf({k: v for k, v in a.items()})
    hf_b = adapter.to_hf({k: v for k, v in b.items()})
    assert sorted(hf_a) == sorted(hf_b)
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in hf_b)


def test_bare_module_expands_to_its_factories():
    expanded, lines = override_imports.expand(["qwen3_titan_nki_moe.overrides"])
    assert expanded == list(KERNEL_OVERRIDES)
    assert lines == [
        f"[override] --override.imports qwen3_titan_nki_moe.overrides -> {', '.join(KERNEL_OVERRIDES)}"
    ]


def test_function_entries_and_kwargs_pass_through():
    entries = ["qwen3_titan_nki_moe.overrides.rope_hf", ("qwen3_titan_nki_moe.overrides.rms_norm", {})]
    assert override_imports.expand(entries) == (entries, [])
    # A module and one of its factories: listed once (torchtitan refuses duplicates).
    expanded, _ = override_imports.expand(
        ["qwen3_titan_nki_moe.overrides.rope_hf", "qwen3_titan_nki_moe.overrides"]
    )
    assert expanded == ["qwen3_titan_nki_moe.overrides.rope_hf", *KERNEL_OVERRIDES[:1], *KERNEL_OVERRIDES[2:]]


def test_unknown_names_are_left_for_torchtitan_to_report():
    assert override_imports.expand(["no_such_module_xyz"]) == (["no_such_module_xyz"], [])


@pytest.fixture
def tmp_modules(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(name: str, source: str) -> None:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))

    yield write
    for name in [m for m in sys.modules if m.startswith("tmp_kernels_")]:
        del sys.modules[name]


def test_a_module_without_factories_is_a_one_line_error(tmp_modules):
    tmp_modules("tmp_kernels_empty", "X = 1\n")
    with pytest.raises(override_imports.OverrideImportError) as err:
        override_imports.expand(["tmp_kernels_empty"])
    assert str(err.value) == (
        "--override.imports tmp_kernels_empty: module 'tmp_kernels_empty' defines no @override factory "
        "(decorate a function with torchtitan.config.override, or name one as module.function)"
    )


def test_a_module_whose_imports_fail_says_so(tmp_modules):
    tmp_modules("tmp_kernels_broken", "import no_such_dependency_xyz\n")
    with pytest.raises(
        override_imports.OverrideImportError,
        match="importing it failed: No module named 'no_such_dependency_xyz'",
    ):
        override_imports.expand(["tmp_kernels_broken"])


USER_ROPE = """
from dataclasses import dataclass
from torchtitan.config import derive, override
from torchtitan.models.common.rope import CosSinRoPE, RoPE


class UserRoPE(CosSinRoPE):
    @dataclass(kw_only=True, slots=True)
    class Config(CosSinRoPE.Config):
        pass

@override(target=RoPE.Config)
def user_rope(cfg):
    return derive(cfg, UserRoPE.Config)
"""


def test_backend_overrides_fill_what_the_user_list_leaves(tmp_modules):
    tmp_modules("tmp_kernels_user", USER_ROPE)
    entries, _ = override_imports.expand(["tmp_kernels_user"])
    completed, lines = override_imports.complete(entries, KERNEL_OVERRIDES)
    assert completed == [
        "tmp_kernels_user.user_rope",
        "qwen3_titan_nki_moe.overrides.grouped_experts",
        "qwen3_titan_nki_moe.overrides.rms_norm",
    ]
    assert (
        "[override] qwen3_titan_nki_moe.overrides.rope_hf not applied: tmp_kernels_user.user_rope overrides CosSinRoPE.Config"
        in lines
    )
    # The backend's full list needs nothing added, and says nothing.
    assert override_imports.complete(list(KERNEL_OVERRIDES), KERNEL_OVERRIDES) == (list(KERNEL_OVERRIDES), [])
    # An empty list gets every backend override.
    assert override_imports.complete([], KERNEL_OVERRIDES)[0] == list(KERNEL_OVERRIDES)


def test_registry_modules_run_their_ops():
    _, overridden, _ = model_configs()
    model = build(overridden)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(torch.randint(0, SMALL_MOE["vocab_size"], (1, 16)))
    ran = {event.key for event in prof.key_averages()}
    assert {"qwen3_titan::grouped_swiglu", "qwen3_titan::rope_hf", "qwen3_titan::rms_norm"} <= ran


def test_factories_take_the_kernel_settings_as_kwargs():
    shape = constraints.KernelShape(seq_len=256, head_dim=32, hidden_size=128, rope_cache_len=2048, lnc=2)
    entries = [(name, {"kernels": "reference", "kernel_shape": shape}) for name in KERNEL_OVERRIDES]
    _, overridden, replaced = model_configs(overrides=entries)
    configs = [cfg for cls in REPLACEMENTS for _, cfg, _, _ in overridden.traverse(cls.Config)]
    assert len(configs) == len(replaced)
    assert all(cfg.kernels == "reference" and cfg.kernel_shape is shape for cfg in configs)
    model = build(overridden)
    reasons = {m.kernel.reason.partition(";")[0] for m in model.modules() if isinstance(m, REPLACEMENTS)}
    assert reasons == {"--kernels reference"}


def test_pass_kwargs_reaches_only_factories_that_declare_them(tmp_modules):
    # A module name of its own: torchtitan's registry outlives the module's import.
    tmp_modules("tmp_kernels_plain", USER_ROPE)
    entries = [
        "tmp_kernels_plain.user_rope",
        "qwen3_titan_nki_moe.overrides.rms_norm",
        "no_such_module_xyz.f",
    ]
    assert override_imports.pass_kwargs(entries, {"kernels": "nki", "other": 1}) == [
        "tmp_kernels_plain.user_rope",  # declares neither: torchtitan would refuse the kwarg
        ("qwen3_titan_nki_moe.overrides.rms_norm", {"kernels": "nki"}),
        "no_such_module_xyz.f",  # torchtitan reports it
    ]


def test_pass_kwargs_keeps_an_entrys_own_kwargs_and_refuses_a_contradiction():
    entry = ("qwen3_titan_nki_moe.overrides.rope_hf", {"kernels": "reference"})
    assert override_imports.pass_kwargs([entry], {"kernels": "reference", "kernel_shape": None}) == [
        ("qwen3_titan_nki_moe.overrides.rope_hf", {"kernels": "reference", "kernel_shape": None})
    ]
    with pytest.raises(override_imports.OverrideImportError) as err:
        override_imports.pass_kwargs([entry], {"kernels": "auto"})
    assert str(err.value) == (
        "--override.imports qwen3_titan_nki_moe.overrides.rope_hf: kernels='reference' in the entry, but this run "
        "sets kernels='auto' for every kernel override (the mode comes from --kernels)"
    )


@pytest.mark.parametrize(
    ("mode", "reason"), [("reference", "--kernels reference"), ("auto", "QWEN3_TITAN_DEVICE=cpu")]
)
def test_the_kernels_flag_reaches_every_override_config(mode, reason, monkeypatch):
    # The real path: torchtitan parses the command line, the trainer's preparation fills the
    # override entries, torchtitan's apply_overrides hands them to the factories.
    from qwen3_titan_nki_moe.trainer import prepare_kernels
    from torchtitan.config.override import apply_overrides

    monkeypatch.setenv("QWEN3_TITAN_DEVICE", "cpu")
    config = parse_debug_moe("--kernels", mode, "--training.seq_len", "512")
    logged = prepare_kernels(config)
    replaced = apply_overrides(config.override, config)
    assert len(replaced) == 11 and all(f"with kernels={mode!r}, kernel_shape=" in line for line in replaced)
    model_config = config.model_spec.model
    configs = [cfg for cls in REPLACEMENTS for _, cfg, _, _ in model_config.traverse(cls.Config)]
    assert len(configs) == 11
    shape = constraints.kernel_shape(config)
    assert shape.seq_len == 512
    assert all(cfg.kernels == mode and cfg.kernel_shape == shape for cfg in configs)
    with torch.device("meta"):
        model = model_config.build()
    modules = [m for m in model.modules() if isinstance(m, REPLACEMENTS)]
    assert len(modules) == 13  # the q/k norm Config builds two modules per layer
    # Each module made the choice the trainer logged for its op.
    assert all(m.kernel == logged[m.kernel.op] for m in modules)
    assert {m.kernel.reason.partition(";")[0] for m in modules} == {reason}
