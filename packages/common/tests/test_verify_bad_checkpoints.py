"""docs/reliability.md, verify-checkpoint's rows: every directory that does not load is exit 2 and one
line naming the file or tensor (transformers' own refusals included); non-finite logits fail the check."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from qwen3_titan_common.scripts.verify import main
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint
from qwen3_titan_testing.edges import changes, check_failure, snapshot
from safetensors.torch import load_file, save_file


@pytest.fixture
def model(tmp_path):
    """A fresh tiny checkpoint for each test to damage (a fraction of a second to make)."""
    return make_tiny_checkpoint(tmp_path / "model")


@pytest.fixture
def refused(tmp_path, capfd):
    def _refused(argv, *culprit):
        capfd.readouterr()
        before = snapshot(tmp_path)
        rc = main([str(a) for a in argv])
        out = capfd.readouterr()
        check_failure(rc, out.out, out.err, 2, *culprit, prefix="verify-checkpoint: ")
        assert changes(before, snapshot(tmp_path)) == []

    return _refused


def _retensor(model: Path, change) -> None:
    tensors = load_file(model / "model.safetensors")
    change(tensors)
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})


def test_missing_directory(refused, tmp_path):
    refused([tmp_path / "nowhere"], "nowhere", "no such directory")


def test_a_file_instead_of_a_directory(refused, model):
    refused([model / "config.json"], "config.json", "is a file, not a directory")


def test_a_hub_name(refused):
    refused(["Qwen/Qwen3-0.6B"], "Qwen/Qwen3-0.6B", "hf download Qwen/Qwen3-0.6B")


def test_no_config(refused, model):
    (model / "config.json").unlink()
    refused([model], "config.json")


def test_missing_layer(refused, model):
    _retensor(model, lambda t: [t.pop(k) for k in [k for k in t if k.startswith("model.layers.1.")]])
    refused([model], "does not fit its config.json", "missing 11")


def test_extra_key(refused, model):
    _retensor(model, lambda t: t.update({"model.extra.weight": torch.ones(3)}))
    refused([model], "unexpected 1: model.extra.weight")


def test_wrong_shape(refused, model):
    _retensor(model, lambda t: t.update({"lm_head.weight": torch.ones(4096, 32)}))
    refused([model], "lm_head.weight (expected [4096, 64], found [4096, 32])")


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_weight(refused, model, value):
    key = "model.layers.0.self_attn.k_proj.weight"
    _retensor(model, lambda t: t[key].__setitem__((1, 2), value))
    refused([model], f"tensor '{key}' holds NaN or Inf values", "model.safetensors")


def test_int8_weights(refused, model):
    _retensor(model, lambda t: t.update({k: v.to(torch.int8) for k, v in t.items()}))
    refused([model], "is int8 on disk", "more such tensors")


def test_truncated_weights(refused, model):
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4000])
    refused([model], "model.safetensors", "truncated")


def test_offsets_that_do_not_match_the_shape(refused, model):
    path = model / "model.safetensors"
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    header["model.norm.weight"]["dtype"] = "F16"  # 64 values of 2 bytes, over 256 bytes of data
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])
    refused([model], "tensor 'model.norm.weight'", "x F16 is 128 bytes", "span 256")


def test_transformers_refuses_the_tokenizer(refused, model):
    (model / "tokenizer.json").write_text("{broken")
    refused([model], str(model), "does not load")


def test_against_a_broken_directory(refused, model, tmp_path):
    refused([model, "--against", tmp_path / "missing"], "--against", "missing")


def test_non_finite_logits_fail(model, capfd):
    # Finite weights whose logits overflow float32: a NaN difference must not compare as "OK".
    _retensor(model, lambda t: t.update({"model.norm.weight": torch.full((64,), 3e38)}))
    assert main([str(model)]) == 1
    out = capfd.readouterr().out.splitlines()
    assert "logits: not finite (NaN or Inf) on the fixed text" in out and out[-1] == "FAILED"


def test_a_good_directory_passes(model, capfd):
    assert main([str(model)]) == 0
    assert capfd.readouterr().out.splitlines()[-1] == "OK"
