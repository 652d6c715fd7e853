import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from qwen3_titan_common.hf.errors import CheckpointError
from qwen3_titan_common.hf.export import ExportSpec, export_hf_dir, parse_size
from qwen3_titan_common.hf.safetensors_writer import write_safetensors
from safetensors import safe_open
from safetensors.torch import load_file


def test_streamed_writer_is_read_back_by_safetensors(tmp_path):
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "empty": torch.zeros(0, 4),
        "strided": torch.randn(4, 6).t(),
    }
    write_safetensors(tmp_path / "x.safetensors", tensors, metadata={"format": "pt"})
    back = load_file(tmp_path / "x.safetensors")
    assert back.keys() == tensors.keys()
    for key, tensor in tensors.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor)
    with safe_open(str(tmp_path / "x.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def _spec(tmp_path, **kw):
    return ExportSpec(
        out_dir=tmp_path / "export",
        config={"model_type": "qwen3", "torch_dtype": "float32"},
        dtype=torch.bfloat16,
        **kw,
    )


def test_shards_index_and_dtype(tmp_path):
    tensors = {f"t{i}": torch.randn(100, 100) for i in range(5)}  # 20 KB each in bf16
    out = export_hf_dir(_spec(tmp_path, max_shard_bytes=45_000), tensors.items())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
    ]
    assert index["metadata"]["total_size"] == 5 * 100 * 100 * 2
    for key, tensor in tensors.items():
        stored = load_file(out / index["weight_map"][key])[key]
        assert stored.dtype == torch.bfloat16 and torch.equal(stored, tensor.to(torch.bfloat16))
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and "torch_dtype" not in config


def test_single_shard_needs_no_index(tmp_path):
    out = export_hf_dir(_spec(tmp_path), [("w", torch.ones(2))])
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()


def test_failed_export_leaves_nothing_behind(tmp_path):
    def tensors():
        yield "w", torch.ones(2)
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        export_hf_dir(_spec(tmp_path), tensors())
    assert list(tmp_path.iterdir()) == []


def test_existing_export_is_replaced_whole(tmp_path):
    export_hf_dir(_spec(tmp_path), [("old", torch.ones(2))])
    out = export_hf_dir(_spec(tmp_path), [("new", torch.ones(2))])
    assert list(load_file(out / "model.safetensors")) == ["new"]
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


def test_not_enough_disk_fails_early_with_numbers(tmp_path):
    with pytest.raises(
        CheckpointError, match=r"not enough free disk space for the export: needs about .* GB free"
    ):
        export_hf_dir(_spec(tmp_path), [("w", torch.ones(2))], expected_bytes=10**18)
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
spec = ExportSpec(out_dir=Path({str(tmp_path / "export")!r}), config={{}}, dtype=torch.float32, max_shard_bytes=8000)
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
    export_hf_dir(_spec(tmp_path), [("w", torch.ones(2))])
    assert [p.name for p in tmp_path.iterdir()] == ["export"]
