import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from qwen3_titan_common.errors import CheckpointError
from qwen3_titan_common.hf.export import (
    EXPORT_MARKER,
    ExportSpec,
    ExportTargetError,
    export_hf_dir,
    parse_size,
)
from qwen3_titan_common.hf.model_dir import open_model_dir
from qwen3_titan_common.runtime.disk import DiskSpaceError
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def _spec(tmp_path, tensors, **kw):
    return ExportSpec(
        out_dir=tmp_path / "export",
        config={"model_type": "qwen3", "torch_dtype": "float32"},
        dtype=torch.bfloat16,
        shapes={key: tuple(tensor.shape) for key, tensor in dict(tensors).items()},
        **kw,
    )


def _export(tmp_path, tensors, **kw):
    return export_hf_dir(_spec(tmp_path, tensors, **kw), dict(tensors).items())


def test_tensors_are_read_back_by_safetensors(tmp_path):
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "empty": torch.zeros(0, 4),
        "strided": torch.randn(4, 6).t(),
    }
    out = _export(tmp_path, tensors)
    back = load_file(out / "model.safetensors")
    assert back.keys() == tensors.keys()
    for key, tensor in tensors.items():
        assert back[key].dtype == torch.bfloat16 and torch.equal(back[key], tensor.to(torch.bfloat16))
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_shards_index_and_dtype(tmp_path):
    tensors = {f"t{i}": torch.randn(100, 100) for i in range(5)}  # 20 KB each in bf16
    out = _export(tmp_path, tensors, max_shard_bytes=45_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
    ]
    assert index["metadata"] == {"total_size": 5 * 100 * 100 * 2, "total_parameters": 5 * 100 * 100}
    for key, tensor in tensors.items():
        stored = load_file(out / index["weight_map"][key])[key]
        assert stored.dtype == torch.bfloat16 and torch.equal(stored, tensor.to(torch.bfloat16))
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and "torch_dtype" not in config


def test_single_shard_needs_no_index(tmp_path):
    out = _export(tmp_path, {"w": torch.ones(2)})
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()


def test_failed_export_leaves_nothing_behind(tmp_path):
    def tensors():
        yield "w", torch.ones(2)
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        export_hf_dir(_spec(tmp_path, {"w": torch.ones(2), "v": torch.ones(2)}), tensors())
    assert list(tmp_path.iterdir()) == []


def test_existing_export_is_replaced_whole(tmp_path):
    _export(tmp_path, {"old": torch.ones(2)})
    out = _export(tmp_path, {"new": torch.ones(2)})
    assert list(load_file(out / "model.safetensors")) == ["new"]
    assert [p.name for p in tmp_path.iterdir()] == ["export"]
    assert json.loads((out / EXPORT_MARKER).read_text())["complete"] is True


def test_a_directory_the_project_did_not_write_is_never_replaced(tmp_path):
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "README.md").write_text("my notes")
    asked = []

    def tensors():
        asked.append(1)
        yield "w", torch.ones(2)

    with pytest.raises(ExportTargetError, match=r"export: exists and is not an export this project wrote"):
        export_hf_dir(_spec(tmp_path, {"w": torch.ones(2)}), tensors())
    assert (tmp_path / "export" / "README.md").read_text() == "my notes"
    assert asked == [] and sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_not_enough_disk_fails_early_with_numbers(tmp_path):
    with pytest.raises(
        DiskSpaceError, match=r"not enough free disk space for the export: needs about .* GB free"
    ):
        export_hf_dir(_spec(tmp_path, {"w": torch.ones(2)}), [("w", torch.ones(2))], expected_bytes=10**18)
    assert list(tmp_path.iterdir()) == []


def test_free_space_is_checked_against_the_plan_before_any_tensor(tmp_path):
    def tensors():
        raise AssertionError("a tensor was asked for")
        yield

    spec = ExportSpec(out_dir=tmp_path / "export", config={}, dtype=torch.float32, shapes={"w": (10**17,)})
    # 4e17 bytes of fp32 tensors, plus the margin for files beyond them
    with pytest.raises(DiskSpaceError, match=r"needs about 440000000\.02 GB \(with margin\)"):
        export_hf_dir(spec, tensors())
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("text", "size"), [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("2GiB", 2 * 1024**3), ("1024", 1024)]
)
def test_parse_size(text, size):
    assert parse_size(text) == size


def test_parse_size_names_the_flag():
    with pytest.raises(CheckpointError, match="--hf.max_shard_size 'lots'"):
        parse_size("lots")


def test_sigkill_during_export_leaves_no_complete_looking_directory(tmp_path):
    script = f"""
import time, torch
from pathlib import Path
from qwen3_titan_common.hf.export import ExportSpec, export_hf_dir
def slow():
    for i in range(1000):
        if i == 3:
            print("writing", flush=True)
        time.sleep(0.01)
        yield f"t{{i}}", torch.ones(1000)
spec = ExportSpec(
    out_dir=Path({str(tmp_path / "export")!r}), config={{}}, dtype=torch.float32, max_shard_bytes=8000,
    shapes={{f"t{{i}}": (1000,) for i in range(1000)}},
)
export_hf_dir(spec, slow())
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "export").exists()
    leftovers = list(tmp_path.iterdir())
    assert all(p.name.startswith(".export.partial-") for p in leftovers)
    assert not any((p / "config.json").exists() for p in leftovers)


def test_a_later_export_clears_partial_leftovers(tmp_path):
    stale = tmp_path / ".export.partial-999999"
    stale.mkdir()
    (stale / "shard-00000.partial").write_bytes(b"x")
    _export(tmp_path, {"w": torch.ones(2)})
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


def test_each_file_is_written_when_its_last_tensor_arrives(tmp_path):
    tensors = {f"t{i}": torch.full((100, 100), float(i)) for i in range(6)}  # 20 KB each in bf16
    spec = _spec(tmp_path, tensors, max_shard_bytes=45_000)
    partial = tmp_path / f".export.partial-{os.getpid()}"
    on_disk_before = []

    def arriving():
        for key, tensor in tensors.items():
            on_disk_before.append(sorted(p.name for p in partial.glob("*.safetensors")))
            yield key, tensor

    out = export_hf_dir(spec, arriving())
    first, second = "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"
    # Files of two tensors: the first is on disk before the third tensor is asked for.
    assert on_disk_before == [[], [], [first], [first], [first, second], [first, second]]
    assert len(list(out.glob("*.safetensors"))) == 3


@pytest.mark.parametrize(
    ("produced", "message"),
    [
        ({"a": (2,)}, "missing 1: b"),
        ({"a": (2,), "b": (3,), "c": (1,)}, "unexpected 1: c"),
        ({"a": (2,), "b": (4,)}, "shape mismatch 1: b (expected [3], found [4])"),
    ],
    ids=["missing", "unexpected", "shape"],
)
def test_tensors_that_do_not_fit_the_plan_are_refused_after_all_arrived(tmp_path, produced, message):
    asked = []

    def tensors():
        for key, shape in produced.items():
            asked.append(key)
            yield key, torch.zeros(shape)

    spec = ExportSpec(
        out_dir=tmp_path / "export", config={}, dtype=torch.float32, shapes={"a": (2,), "b": (3,)}
    )
    with pytest.raises(CheckpointError, match="checkpoint does not fit the model") as info:
        export_hf_dir(spec, tensors())
    assert message in str(info.value) and str(tmp_path / "export") in str(info.value)
    assert asked == list(produced)  # every tensor was still gathered: other ranks take part in each
    assert list(tmp_path.iterdir()) == []


def test_a_tensor_produced_twice_is_refused(tmp_path):
    spec = ExportSpec(
        out_dir=tmp_path / "export", config={}, dtype=torch.float32, shapes={"a": (2,), "b": (2,)}
    )
    tensors = [("a", torch.zeros(2)), ("a", torch.zeros(2)), ("b", torch.zeros(2))]
    with pytest.raises(CheckpointError, match="tensor 'a' produced twice"):
        export_hf_dir(spec, tensors)
    assert list(tmp_path.iterdir()) == []


def test_files_and_index_are_those_of_save_pretrained(tmp_path):
    reference = make_tiny_checkpoint(tmp_path / "reference", max_shard_size="60KB", with_tokenizer=False)
    model = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    # save_pretrained writes the model's state dict in its own order, without the tied lm_head.
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    config = json.loads((reference / "config.json").read_text())
    shapes = {key: tuple(tensor.shape) for key, tensor in state.items()}
    spec = ExportSpec(
        out_dir=tmp_path / "export", config=config, dtype=torch.float32, max_shard_bytes=60_000, shapes=shapes
    )
    out = export_hf_dir(spec, iter(state.items()))
    index = (reference / "model.safetensors.index.json").read_text()
    assert (out / "model.safetensors.index.json").read_text() == index
    shards = sorted(set(json.loads(index)["weight_map"].values()))
    assert len(shards) > 2
    for name in shards:
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name


def test_export_planned_from_the_config_loads_in_transformers(tmp_path):
    source = make_tiny_checkpoint(tmp_path / "source", moe=True, with_tokenizer=False)
    model_dir = open_model_dir(source)
    stored = load_file(source / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    spec = ExportSpec(
        out_dir=tmp_path / "export",
        config=config,
        dtype=torch.bfloat16,
        max_shard_bytes=100_000,
        assets_dir=source,
    )
    out = export_hf_dir(spec, iter(stored.items()))
    exported = open_model_dir(out)
    assert len(exported.weight_files) > 1 and exported.dtype_name == "bfloat16"
    assert {k: e.shape for k, e in exported.tensors.items()} == {
        k: e.shape for k, e in model_dir.tensors.items()
    }
    before = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).state_dict()
    after = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert after.keys() == before.keys()
    for key, tensor in before.items():
        assert torch.equal(after[key], tensor.to(torch.bfloat16).float()), key
