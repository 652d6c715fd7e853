"""One test per seam of ``qwen3_titan_common.compat``, each against the installed torch and torchtitan.

If an upgrade renames or removes a private name these seams use, the matching test here fails, and
compat.py is the one file to change.
"""

from __future__ import annotations

import inspect
import logging
import types
from typing import Literal

import pytest
import torch
from qwen3_titan_common import compat


def test_versions_are_checked_from_the_package_metadata(monkeypatch, caplog):
    assert compat._installed("torchtitan") == compat.TORCHTITAN  # the environment this suite runs in
    versions = {"torchtitan": "0.4.0", "torch": "2.14.1"}
    monkeypatch.setattr(compat, "_installed", versions.get)
    with pytest.raises(
        compat.UnsupportedUpstreamError, match=r"torchtitan 0\.4\.0 is installed; .* 0\.3\.0 only"
    ):
        compat.check_versions()
    versions.update(torchtitan="0.3.0", torch="2.11.0+cu130")
    with caplog.at_level(logging.WARNING, logger="qwen3_titan_common.compat"):
        compat.check_versions()
    assert "torch 2.11.0+cu130 is installed; qwen3-titan is tested with torch 2.14" in caplog.text


def test_the_subclass_hooks_are_the_upstream_classes_own_and_called_by_their_public_methods():
    from torchtitan.components.checkpoint import CheckpointManager

    hooks = compat.subclass_hooks()
    assert CheckpointManager in hooks
    for owner, names in hooks.items():
        for name in names:
            assert inspect.isfunction(getattr(owner, name, None)), f"{owner.__qualname__}.{name} is gone"
    # What overriding them relies on: the public entry points dispatch to them after their own guard, and
    # the save hook asks _should_save (so ours, asking it first, writes exactly when upstream's would).
    assert "self._save(curr_step, last_step)" in inspect.getsource(CheckpointManager.save)
    assert "self._load(step)" in inspect.getsource(CheckpointManager.load)
    assert "self._should_save(curr_step, last_step)" in inspect.getsource(CheckpointManager._save)
    from torchtitan.protocols.module import Module

    assert "self._init_self_buffers(buffer_device=buffer_device)" in inspect.getsource(Module.init_states)


def test_cpu_device_replaces_what_torchtitan_reads_at_import(caplog):
    import math

    import torchtitan.tools.utils as titan_utils

    # The two globals torchtitan's modules copy at import: the seam relies on their names.
    assert hasattr(titan_utils, "device_type") and hasattr(titan_utils, "device_module")
    upstream_peak = titan_utils.get_peak_flops
    if titan_utils.device_type == "cpu":  # this process's torchtitan already went through the seam
        upstream_peak = upstream_peak.__closure__[0].cell_contents
    fake = types.SimpleNamespace(device_type="cuda", device_module=torch.cuda, get_peak_flops=upstream_peak)
    compat.use_cpu_device(fake)
    assert fake.device_type == "cpu" and fake.device_module is compat.CpuDeviceModule
    # The CPU has no peak, and asking torchtitan (lspci, then an A100 fallback) would warn twice.
    with caplog.at_level(logging.WARNING):
        assert math.isnan(fake.get_peak_flops(compat.CpuDeviceModule.get_device_name()))
    assert caplog.records == []
    # Other device names still get torchtitan's table.
    assert fake.get_peak_flops("NVIDIA H200") == upstream_peak("NVIDIA H200") == 989e12
    # torchtitan's profiler and memory monitor call these on device_module.
    stats = compat.CpuDeviceModule.memory_stats()
    assert stats["reserved_bytes.all.peak"] > 0 and compat.CpuDeviceModule.memory._snapshot() == {}


def test_override_registry_lookup_finds_registered_factories():
    from torchtitan.config import override
    from torchtitan.models.common.nn_modules import RMSNorm

    @override(target=RMSNorm.Config, description="compat seam test")
    def _compat_seam_factory(cfg):
        return cfg

    name = f"{_compat_seam_factory.__module__}._compat_seam_factory"  # torchtitan keys by module.function
    assert compat.registered_override(name) is not None
    assert name in compat.registered_override_names()
    assert compat.registered_override("no.such.factory") is None


def test_computed_buffers_are_filled_on_a_model_built_on_meta():
    from qwen3_titan_common.assets import default_architecture
    from qwen3_titan_common.models.qwen3 import titan_qwen3_model_config

    config = titan_qwen3_model_config(default_architecture())
    torch.manual_seed(0)
    reference = config.build()
    reference.init_states()
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    compat.init_computed_buffers(model)
    # Every module's buffer, shared ones included (each layer's RoPE module holds the model's one cache).
    expected = dict(reference.named_buffers(remove_duplicate=False))
    got = dict(model.named_buffers(remove_duplicate=False))
    assert expected and expected.keys() == got.keys()
    for name, buffer in expected.items():
        assert torch.equal(got[name], buffer), name


def test_checkpoint_wrapper_prefix_is_stripped():
    from torchtitan.distributed.activation_checkpoint import FullAC

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({"0": torch.nn.Linear(4, 4)})
    FullAC.Config().build(dump_folder="").apply(model)
    names = [name for name, _ in model.named_parameters()]
    assert any("._checkpoint_wrapped_module" in name for name in names), names
    assert sorted(compat.without_checkpoint_wrapper(n) for n in names) == ["layers.0.bias", "layers.0.weight"]


def test_lm_head_flag_is_the_one_torchtitans_trainer_sets():
    from torchtitan import trainer

    assert "._skip_lm_head = True" in inspect.getsource(trainer.Trainer.__init__)
    model = torch.nn.Linear(2, 2)
    assert compat.lm_head_applied_by_loss(model) is False
    model._skip_lm_head = True
    assert compat.lm_head_applied_by_loss(model) is True


def test_hf_reader_reads_an_alias_from_the_stored_tensor(tmp_path):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    embed = torch.randn(8, 4)
    save_file({"model.embed_tokens.weight": embed}, str(tmp_path / "model.safetensors"))
    state = {"model.embed_tokens.weight": torch.zeros(8, 4), "lm_head.weight": torch.zeros(8, 4)}
    reader = compat.hf_storage_reader_with_aliases(
        str(tmp_path), {"lm_head.weight": "model.embed_tokens.weight"}, note="tied"
    )
    dcp.load(state, storage_reader=reader)
    assert torch.equal(state["lm_head.weight"], embed) and torch.equal(
        state["model.embed_tokens.weight"], embed
    )


def _tracked_step(model: torch.nn.Module) -> tuple[dict, dict]:
    """The tracker's figures by kind after one fake step of ``model`` and AdamW on its trainable weights, and at
    the step's peak."""
    with compat.fake_tensor_mode():
        model = model.to_empty(device="cpu")  # fake weights
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        inputs = torch.randn(8, 256)
        tracker = compat.step_memory_tracker(model, optimizer, (inputs,))
        with tracker:
            model(inputs).sum().backward()
            optimizer.step()
            current = compat.tracker_current_by_kind(tracker)
        return current, compat.tracker_peak_by_kind(tracker)


def test_the_memory_tracker_counts_fake_tensors_by_kind():
    current, peak = _tracked_step(torch.nn.Linear(256, 512, device="meta"))
    weights = 4 * (256 * 512 + 512)
    assert current["Parameter"] == weights and current["Gradient"] == weights
    assert current["Optstate"] >= 2 * weights  # both AdamW moments
    assert "Total" not in peak and sum(peak.values()) >= sum(current.values())


def test_the_memory_tracker_takes_a_frozen_parameter():
    """torch refuses a gradient hook on a frozen tensor; the tracker counts it as a weight and its
    trainable neighbour's gradient and state alone (LoRA's base and adapters)."""
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512, device="meta"), torch.nn.Linear(512, 8, device="meta")
    )
    model[0].requires_grad_(False)
    current, _ = _tracked_step(model)
    frozen, trained = 4 * (256 * 512 + 512), 4 * (512 * 8 + 8)
    assert current["Parameter"] == frozen + trained and current["Gradient"] == trained
    assert 2 * trained <= current["Optstate"] < 2 * trained + 64  # both AdamW moments, and its step counters


def test_gloo_copies_are_held_while_the_collective_runs():
    import torch.distributed as dist

    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=2)
    try:
        with compat.fake_tensor_mode():
            tracker = compat.step_memory_tracker(torch.nn.Linear(2, 2), None, ())
            data, out = torch.empty(1024, 1024), torch.empty(512, 1024)
            with tracker, compat.gloo_collective_copies(2):
                dist.reduce_scatter_tensor(out, data)
            peak = sum(compat.tracker_peak_by_kind(tracker).values())
    finally:
        dist.destroy_process_group()
    # The two 4 MiB scratch copies of the input were alive during the reduce-scatter.
    assert peak >= 2 * 4 * 1024 * 1024


def test_recorded_ops_names_each_aten_op_its_output_shapes_and_a_host_read():
    x = torch.ones(3, 4)
    with compat.recorded_ops() as recorded:
        y = x.sum(dim=0)
        bool(y.max() > 0)
    ops = [op for op, _ in recorded.ops]
    assert ("aten.sum.dim_IntList", ((4,),)) in recorded.ops
    assert any("_local_scalar_dense" in op for op in ops)


def test_the_cpu_flash_attention_kernel_is_sdpa_under_a_mask_forward_and_backward():
    # The op SDPA dispatches to on the CPU, called directly: the same output and gradients as the public
    # function under the same additive mask (grouped-query: 4 query heads over 2 kv heads), in fp64.
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 16, 8, dtype=torch.float64, generator=generator, requires_grad=True)
    k, v = (
        torch.randn(3, 2, 24, 8, dtype=torch.float64, generator=generator, requires_grad=True) for _ in "kv"
    )
    allowed = torch.rand(3, 1, 16, 24, generator=generator) < 0.7
    allowed[..., 0] = True  # every query sees a key
    mask = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill_(~allowed, -torch.inf)
    out, lse = compat.cpu_flash_attention(q, k, v, mask_B1LS=mask, scale=0.3)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True
    )
    torch.testing.assert_close(out, expected)
    assert lse.shape == (3, 4, 16)
    grad_out = torch.randn(out.shape, dtype=torch.float64, generator=generator)
    grads = compat.cpu_flash_attention_backward(grad_out, q, k, v, out, lse, mask_B1LS=mask, scale=0.3)
    for ours, theirs in zip(grads, torch.autograd.grad(expected, (q, k, v), grad_out), strict=True):
        torch.testing.assert_close(ours, theirs)


def test_tyros_parse_error_hook_raises_ours_with_what_it_refused():
    from dataclasses import dataclass

    import tyro

    @dataclass
    class Small:
        steps: int = 1
        dtype: Literal["bf16", "fp32"] = "fp32"

    class Refused(Exception):
        pass

    class Earlier(Exception):
        pass

    undo_earlier = compat.raise_on_refused_command_line(lambda refused: Earlier(refused))
    undo = compat.raise_on_refused_command_line(lambda refused: Refused(refused))
    assert undo is not None and undo_earlier is not None
    try:
        _refuse_each(tyro, Small, Refused)
        undo()
        with pytest.raises(Earlier):  # the hook set before is back
            tyro.cli(Small, args=["--stpes"])
    finally:
        undo_earlier()


def _refuse_each(tyro, Small, Refused) -> None:
    for args, kind, fields in (
        (["--stpes", "3"], "unrecognized", {"tokens": ("--stpes", "3")}),
        (["--steps", "x"], "invalid_value", {"flag": "--steps"}),
        (["--steps"], "missing_value", {"flag": "--steps"}),
        (
            ["--dtype", "fp8"],
            "invalid_choice",
            {"flag": "--dtype", "value": "fp8", "choices": ("bf16", "fp32")},
        ),
    ):
        with pytest.raises(Refused) as raised:
            tyro.cli(Small, args=args)
        refused = raised.value.args[0]
        assert refused.kind == kind, (args, refused)
        assert all(getattr(refused, name) == value for name, value in fields.items()), (args, refused)
    assert tyro.cli(Small, args=["--steps", "4"]).steps == 4  # what parses is untouched
