"""Every kind of bad input: one line naming the culprit, a non-zero exit, nothing written.

Each case runs the real `train` command. The first group is stopped by the launcher
before any rank starts; the second inside the rank, before the Trainer creates the
dump folder (docs/bad-inputs.md lists them all).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint
from safetensors.torch import load_file, save_file

TRAIN = str(Path(sys.executable).with_name("train"))
ENV = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": "native-backend"}


def _fails(tmp_path, args, *culprit, env=None):
    out = tmp_path / "out"
    proc = subprocess.run(
        [TRAIN, *args, "--dump_folder", str(out)], cwd=tmp_path, env={**ENV, **(env or {})},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0
    last = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1]
    assert last.startswith("train: "), proc.stdout[-2000:] + proc.stderr[-2000:]
    for fragment in culprit:
        assert fragment in last
    assert not out.exists()
    return last


# -- stopped by the launcher ------------------------------------------------------


def test_unknown_config(tmp_path):
    _fails(tmp_path, ["--config", "qwen3_70b"], "--config qwen3_70b", "available: debug")


def test_unknown_module(tmp_path):
    _fails(tmp_path, ["--module", "not_a_module"], "--module not_a_module")


def test_nproc_zero(tmp_path):
    _fails(tmp_path, ["--nproc", "0"], "--nproc=0", "positive integer")


def test_multi_node_without_rendezvous(tmp_path):
    _fails(tmp_path, ["--nnodes", "2"], "--nnodes=2", "--rdzv-endpoint")


def test_node_rank_out_of_range(tmp_path):
    _fails(tmp_path, ["--nnodes", "2", "--node-rank", "5", "--rdzv-endpoint", "h:1"], "--node-rank=5")


def test_unknown_forced_device(tmp_path):
    _fails(tmp_path, [], "QWEN3_TITAN_DEVICE='tpu'", env={"QWEN3_TITAN_DEVICE": "tpu"})


def test_unknown_backend(tmp_path):
    proc = subprocess.run(
        [TRAIN],
        cwd=tmp_path,
        env={**ENV, "QWEN3_TITAN_BACKEND": "jax-backend"},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "QWEN3_TITAN_BACKEND=jax-backend" in proc.stderr.splitlines()[-1]


def test_model_dir_missing(tmp_path):
    _fails(tmp_path, ["--hf-model", str(tmp_path / "nowhere")], "nowhere", "no such directory")


def test_model_dir_remote(tmp_path):
    _fails(tmp_path, ["--hf.model_dir", "hf://Qwen/Qwen3-4B"], "hf://Qwen/Qwen3-4B", "hf download")


def test_model_dir_without_config(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt")
    (ckpt / "config.json").unlink()
    _fails(tmp_path, ["--hf-model", str(ckpt)], "config.json: not found")


def test_model_dir_with_pickle_weights_only(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt")
    (ckpt / "model.safetensors").unlink()
    torch.save({"w": torch.zeros(1)}, ckpt / "pytorch_model.bin")
    _fails(tmp_path, ["--hf-model", str(ckpt)], "pytorch_model.bin", "never loaded")


def test_model_dir_with_a_shape_mismatch(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt")
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    _fails(tmp_path, ["--hf-model", str(ckpt)], "model.norm.weight (expected [64], found [65])")


def test_model_dir_with_unsupported_rope_scaling(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (ckpt / "config.json").write_text(json.dumps(config))
    _fails(tmp_path, ["--hf-model", str(ckpt)], "rope_scaling")


def test_lora_adapter_missing(tmp_path):
    _fails(
        tmp_path, ["--lora.adapter", str(tmp_path / "nowhere")], "--lora.adapter", "nowhere",
        "no adapter_config.json there",
    )  # fmt: skip


# -- stopped inside the rank, before anything is written ----------------------------


@pytest.mark.slow
def test_sequence_longer_than_the_model(tmp_path):
    _fails(
        tmp_path, ["--training.seq_len", "4096"], "--training.seq_len 4096", "max_position_embeddings 2048"
    )


@pytest.mark.slow
def test_zero_steps(tmp_path):
    _fails(tmp_path, ["--training.steps", "0"], "--training.steps 0")


@pytest.mark.slow
def test_zero_batch(tmp_path):
    _fails(tmp_path, ["--training.local_batch_size", "0"], "--training.local_batch_size 0")


@pytest.mark.slow
def test_parallel_degree_that_does_not_fit_the_devices(tmp_path):
    _fails(tmp_path, ["--parallelism.tensor_parallel_degree", "2"], "tensor 2", "1 ranks")


@pytest.mark.slow
def test_dataset_path_missing(tmp_path):
    _fails(tmp_path, ["--dataloader.dataset", str(tmp_path / "data.jsonl")], "data.jsonl")


@pytest.mark.slow
def test_dataset_in_an_unsupported_format(tmp_path):
    (tmp_path / "data.csv").write_text("a,b\n1,2\n")
    _fails(tmp_path, ["--dataloader.dataset", str(tmp_path / "data.csv")], "data.csv")


@pytest.mark.slow
def test_tokenizer_directory_without_tokenizer(tmp_path):
    (tmp_path / "assets").mkdir()
    _fails(tmp_path, ["--hf_assets_path", str(tmp_path / "assets")], "tokenizer.json")


@pytest.mark.slow
def test_override_import_that_does_not_exist(tmp_path):
    _fails(
        tmp_path, ["--override.imports", "no_such_kernels.rope"], "--override.imports no_such_kernels.rope"
    )


@pytest.mark.slow
def test_bad_shard_size(tmp_path):
    _fails(tmp_path, ["--hf.max_shard_size", "lots"], "--hf.max_shard_size 'lots'")


@pytest.mark.slow
def test_checkpoint_interval_zero(tmp_path):
    # torchtitan's own check, reported through its CLI parser's message.
    _fails(tmp_path, ["--checkpoint.interval", "0"], "checkpoint", "interval")


@pytest.mark.slow
def test_lora_dropout_out_of_range(tmp_path):
    _fails(tmp_path, ["--lora.rank", "4", "--lora.dropout", "1.5"], "--lora.dropout 1.5", "[0, 1)")


@pytest.mark.slow
def test_lora_with_tensor_parallelism(tmp_path):
    _fails(
        tmp_path, ["--lora.rank", "4", "--parallelism.tensor_parallel_degree", "2"],
        "--parallelism.tensor_parallel_degree 2", "FSDP2",
    )  # fmt: skip
