"""Broken model directories: one clear line, a non-zero exit, nothing trained or written."""

import json

import pytest
import torch
from qwen3_titan_common.arch.architecture import ArchitectureError
from qwen3_titan_common.errors import CheckpointError
from qwen3_titan_common.hf.start import open_checked_model_dir
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint
from safetensors.torch import load_file, save_file


@pytest.fixture
def sharded(tmp_path):
    return make_tiny_checkpoint(tmp_path / "ckpt", max_shard_size="60KB")


@pytest.fixture
def single(tmp_path):
    return make_tiny_checkpoint(tmp_path / "single")


def _fails(path, error_type, *fragments):
    with pytest.raises(error_type) as info:
        open_checked_model_dir(str(path))
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message
    return message


def test_missing_config_json(single):
    (single / "config.json").unlink()
    _fails(single, ArchitectureError, "config.json: not found")


def test_index_naming_a_missing_shard(sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    second = sorted(set(index["weight_map"].values()))[1]
    (sharded / second).unlink()
    _fails(sharded, CheckpointError, "model.safetensors.index.json", second, "missing")


def test_truncated_safetensors(single):
    weights = single / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    _fails(single, CheckpointError, "model.safetensors", "truncated")


def test_corrupt_safetensors_header(single):
    weights = single / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:16] = b"garbage!"
    weights.write_bytes(bytes(data))
    _fails(single, CheckpointError, "model.safetensors", "corrupt")


def test_shape_mismatch_names_key_and_both_shapes(single):
    tensors = load_file(single / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(100, 64)
    save_file(tensors, single / "model.safetensors", metadata={"format": "pt"})
    _fails(single, CheckpointError, "model.layers.1.mlp.up_proj.weight (expected [128, 64], found [100, 64])")


def test_missing_and_unexpected_keys_reported_together(single):
    tensors = load_file(single / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_norm.weight"]
    tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    save_file(tensors, single / "model.safetensors", metadata={"format": "pt"})
    message = _fails(single, CheckpointError, "missing 1: model.layers.0.self_attn.k_norm.weight")
    assert "unexpected 1: model.layers.0.self_attn.extra.weight" in message


def test_untied_checkpoint_without_lm_head_is_refused(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "untied", tied=False)
    tensors = load_file(path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    _fails(path, CheckpointError, "missing 1: lm_head.weight")


def test_tied_checkpoint_may_omit_lm_head(single):
    model_dir = open_checked_model_dir(str(single))
    assert "lm_head.weight" not in model_dir.tensors and model_dir.architecture.tie_word_embeddings


def test_pickle_weights_are_refused_without_unpickling(single, monkeypatch):
    (single / "model.safetensors").unlink()
    torch.save({"x": torch.zeros(1)}, single / "pytorch_model.bin")

    def tripwire(*args, **kwargs):
        raise AssertionError("torch.load was called")

    monkeypatch.setattr(torch, "load", tripwire)
    _fails(single, CheckpointError, "pytorch_model.bin", "never loaded", "save_pretrained")


def test_remote_path_is_refused_with_a_download_hint():
    _fails("s3://bucket/Qwen3-4B", CheckpointError, "s3://bucket/Qwen3-4B", "aws s3 cp --recursive")


def test_relative_path_is_resolved(single, monkeypatch):
    monkeypatch.chdir(single.parent)
    assert open_checked_model_dir(single.name).path == single.resolve()


def test_missing_recipe_directory_says_how_to_download(tmp_path):
    with pytest.raises(CheckpointError, match="hf download Qwen/Qwen3-4B-Instruct-2507"):
        from qwen3_titan_common.hf.start import plan_start

        plan_start(
            model_dir=str(tmp_path / "assets/hf/Qwen3-4B-Instruct-2507"),
            checkpoint_folder=tmp_path / "none",
            checkpoint_enabled=True,
            download_hint="hf download Qwen/Qwen3-4B-Instruct-2507 --local-dir assets/hf/Qwen3-4B-Instruct-2507",
        )


def test_index_pointing_at_the_wrong_shard(sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    key = next(k for k, v in index["weight_map"].items() if v == shards[-1])
    index["weight_map"][key] = shards[0]
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    _fails(sharded, CheckpointError, f"says '{key}' is in {shards[0]}, which does not hold it")


def test_truncated_safetensors_says_by_how_much(single):
    weights = single / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-100])
    _fails(
        single,
        CheckpointError,
        f"{weights}: truncated",
        f"({len(data) - 100} bytes, header promises {len(data)})",
    )


def test_bytes_beyond_the_tensors_are_refused(single):
    weights = single / "model.safetensors"
    weights.write_bytes(weights.read_bytes() + b"\0" * 16)
    message = _fails(single, CheckpointError, f"{weights}: corrupt safetensors file")
    assert "truncated" not in message


def test_header_length_beyond_the_file(single):
    weights = single / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes((len(data) * 2).to_bytes(8, "little") + data[8:])
    _fails(single, CheckpointError, f"{weights}: corrupt or truncated", "> file")


def test_file_shorter_than_the_header_length(single):
    (single / "model.safetensors").write_bytes(b"\x01\x02")
    _fails(single, CheckpointError, "model.safetensors: not a safetensors file")


def test_index_without_a_weight_map_object(sharded):
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.norm.weight"]}))
    _fails(sharded, CheckpointError, "model.safetensors.index.json: not a safetensors index")


def test_index_with_an_empty_weight_map(sharded):
    # Was an internal error: an empty map read as "no index", then the single file it does not have.
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    _fails(sharded, CheckpointError, "model.safetensors.index.json: its 'weight_map' is empty")


def test_corrupt_shard_named_by_an_index(sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    second = sharded / sorted(set(index["weight_map"].values()))[1]
    data = bytearray(second.read_bytes())
    data[8:16] = b"garbage!"
    second.write_bytes(bytes(data))
    _fails(sharded, CheckpointError, f"{second}: corrupt safetensors header")
