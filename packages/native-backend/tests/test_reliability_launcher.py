"""docs/reliability.md, the rows the launcher stops before any rank starts.

Each case runs, in this process, what ``train`` and its first rank check before anything is written
(``qwen3_titan_testing.edges.checks_in_process``: the launcher's own checks, then the config parsed as
the rank parses it and ``Qwen3Trainer.resolved_and_checked``, the function every rank runs first), so torchtitan is
imported once for all of them. Each asserts the exit code, one ``train:`` line naming the culprit, no
traceback or torchrun report, and that nothing under the test's directory (the dump folder, the user's
model and data files) was created, changed or deleted.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from qwen3_titan_common.components.model_record import model_record, write_model_record
from qwen3_titan_common.train.dump_lock import DumpFolderLock
from qwen3_titan_native import BACKEND
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint
from qwen3_titan_testing.edges import changes, check_failure, checks_in_process, snapshot
from safetensors.torch import load_file, save_file

GOOD = json.dumps({"text": "A perfectly fine document with some words in it."})
GOOD_CHAT = json.dumps(
    {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hi."}]}
)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """One tiny real checkpoint (config.json, safetensors, tokenizer), copied into each test that needs one."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("pristine") / "model")


@pytest.fixture
def model(tmp_path, pristine):
    return Path(shutil.copytree(pristine, tmp_path / "model"))


@pytest.fixture
def fails(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("QWEN3_TITAN_DEVICE", "cpu")

    def _fails(argv, *culprit, code=2, dump=True):
        capfd.readouterr()
        before = snapshot(tmp_path)
        args = [*argv, "--dump_folder", str(tmp_path / "out")] if dump else list(argv)
        rc = checks_in_process(BACKEND, args)
        out = capfd.readouterr()
        failure = check_failure(rc, out.out, out.err, code, *culprit)
        assert changes(before, snapshot(tmp_path)) == []
        return failure.line

    return _fails


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# -- launcher flags ------------------------------------------------------------------------------


def test_config_unknown(fails):
    fails(["--config", "qwen3_70b"], "--config qwen3_70b", "available: debug")


def test_module_unknown(fails):
    fails(["--module", "not_a_module"], "--module not_a_module")


def test_nproc_zero(fails):
    fails(["--nproc", "0"], "--nproc=0", "positive integer")


def test_nproc_not_a_number(fails):
    fails(["--nproc", "four"], "--nproc", "invalid int value: 'four'")


def test_nnodes_zero(fails):
    fails(["--nnodes", "0"], "--nnodes=0", "positive integer")


def test_multi_node_without_rendezvous(fails, monkeypatch):
    for name in ("MASTER_ADDR", "RDZV_ENDPOINT", "SLURM_NNODES"):
        monkeypatch.delenv(name, raising=False)
    fails(["--nnodes", "2"], "--nnodes=2", "--rdzv-endpoint")


def test_node_rank_out_of_range(fails):
    fails(["--nnodes", "2", "--node-rank", "5", "--rdzv-endpoint", "h:1"], "--node-rank=5")


def test_forced_device_unknown(fails, monkeypatch):
    monkeypatch.setenv("QWEN3_TITAN_DEVICE", "tpu")
    fails([], "QWEN3_TITAN_DEVICE='tpu'")


# -- torchtitan flags, parsed by torchtitan's own parser in the launcher ------------------------------


def test_torchtitan_flag_unknown(fails):
    fails(["--training.stepz", "5"], "--training.stepz")


def test_torchtitan_flag_wrong_type(fails):
    fails(["--training.steps", "many"], "many")


def test_torchtitan_boolean_with_equals(fails):
    fails(["--checkpoint.enable=False"], "--checkpoint.enable=False")


def test_checkpoint_interval_zero(fails):
    fails(["--checkpoint.interval", "0"], "interval")


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--training.steps", "0"), ("--training.steps", "-5"), ("--training.local_batch_size", "0"),
     ("--training.seq_len", "0")],
    ids=["steps-zero", "steps-negative", "batch-zero", "seq-len-zero"],
)  # fmt: skip
def test_counts_below_one(fails, flag, value):
    fails([flag, value], f"{flag} {value}", "expected a positive integer")


def test_seq_len_longer_than_the_model(fails):
    fails(["--training.seq_len", "4096"], "--training.seq_len 4096", "max_position_embeddings 2048")


# -- parallel layout ---------------------------------------------------------------------------


def test_seq_len_not_divisible_by_tensor_parallel(fails):
    fails(
        ["--nproc", "2", "--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "255"],
        "--training.seq_len 255", "multiple of 2", "tensor_parallel_degree 2",
    )  # fmt: skip


def test_dry_run_runs_the_same_checks(fails):
    # A dry run must refuse what the run would die of, not say "ok".
    fails(
        ["--dry-run", "--nproc", "2", "--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "255"],
        "--training.seq_len 255", "multiple of 2",
    )  # fmt: skip


def test_seq_len_not_divisible_by_context_parallel(fails):
    fails(
        ["--nproc", "2", "--parallelism.context_parallel_degree", "2", "--training.seq_len", "258"],
        "--training.seq_len 258", "multiple of 4", "context_parallel_degree 2",
    )  # fmt: skip


def test_context_parallel_row_that_does_not_split(fails):
    fails(
        ["--nproc", "2", "--parallelism.context_parallel_degree", "2", "--seq-len", "102"],
        "--training.seq_len 102", "2 x --parallelism.context_parallel_degree 2", "nearest valid: 104",
    )  # fmt: skip


def test_tensor_parallel_degree_and_kv_heads(fails):
    fails(
        ["--nproc", "4", "--parallelism.tensor_parallel_degree", "4"],
        "--parallelism.tensor_parallel_degree 4", "num_key_value_heads 2",
    )  # fmt: skip


def test_pipeline_parallel_of_a_tied_model(fails):
    # The debug model ties lm_head to the embeddings: no pipeline stage can hold both ends.
    fails(
        ["--nproc", "2", "--parallelism.pipeline_parallel_degree", "2"],
        "--parallelism.pipeline_parallel_degree 2", "tie_word_embeddings true", "untied",
    )  # fmt: skip


def test_pipeline_stages_without_a_micro_batch_each(fails, tmp_path):
    untied = make_tiny_checkpoint(tmp_path / "untied", tied=False)
    fails(
        ["--hf-model", str(untied), "--nproc", "2", "--parallelism.pipeline_parallel_degree", "2",
         "--batch-size", "1"],
        "--training.local_batch_size (--batch-size) 1", "fewer than the 2 stages", "use --batch-size 2 or more",
    )  # fmt: skip


def test_more_experts_per_token_than_experts(fails, tmp_path, pristine_moe):
    moe = Path(shutil.copytree(pristine_moe, tmp_path / "moe"))
    config = json.loads((moe / "config.json").read_text())
    config["num_experts_per_tok"] = (config.get("num_experts") or config["num_local_experts"]) + 1
    _write(moe / "config.json", json.dumps(config))
    fails(["--hf-model", str(moe)], "config.json: num_experts_per_tok=5 is more than num_experts=4")


def test_expert_parallel_of_a_dense_model(fails):
    fails(
        ["--nproc", "2", "--parallelism.expert_parallel_degree", "2"],
        "--parallelism.expert_parallel_degree 2", "dense", "use 1",
    )  # fmt: skip


def test_expert_capacity_of_a_dense_model(fails):
    fails(["--moe.capacity_factor", "2"], "--moe.capacity_factor 2.0", "dense")


def test_tensor_parallel_larger_than_the_ranks(fails):
    fails(["--nproc", "1", "--parallelism.tensor_parallel_degree", "2"], "tensor 2", "1 ranks")


def test_degrees_that_do_not_multiply(fails):
    fails(["--nproc", "4", "--parallelism.data_parallel_shard_degree", "3"], "dp_shard 3", "expected 4 ranks")


def test_degree_zero(fails):
    fails(["--parallelism.tensor_parallel_degree", "0"], "--parallelism.tensor_parallel_degree=0")


def test_expert_parallel_and_experts(fails, tmp_path):
    moe = make_tiny_checkpoint(tmp_path / "moe", moe=True)  # 4 experts
    fails(
        ["--hf-model", str(moe), "--nproc", "3", "--parallelism.expert_parallel_degree", "3",
         "--training.disable_cuda_graphs"],
        "--parallelism.expert_parallel_degree 3", "num_experts 4",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "culprit"),
    [
        (
            ["--lr", "-0.001"],
            "--optimizer.param_groups.0.optimizer_kwargs.lr -0.001 (--lr): expected a number >= 0",
        ),
        (
            ["--lr", "nan"],
            "--optimizer.param_groups.0.optimizer_kwargs.lr nan (--lr): expected a number >= 0",
        ),
        (
            ["--optimizer.param_groups.0.optimizer_kwargs.eps", "0"],
            "optimizer_kwargs.eps 0.0: expected a positive number",
        ),
        (
            ["--optimizer.param_groups.0.optimizer_kwargs.weight_decay", "-1"],
            "weight_decay -1.0: expected a number >= 0",
        ),
    ],
    ids=["lr-negative", "lr-nan", "eps-zero", "weight-decay-negative"],
)
def test_optimizer_values_no_one_means(fails, argv, culprit):
    fails(argv, culprit)


@pytest.mark.parametrize(
    ("argv", "culprit"),
    [
        (["--lora.alpha", "8"], "--lora.alpha 8.0: has no effect without --lora.rank R"),
        (["--lora.rank", "0", "--lora.merge"], "--lora.merge True: has no effect without --lora.rank R"),
        (["--lora.targets", "q_proj,v_proj"], "--lora.targets q_proj,v_proj: has no effect"),
    ],
    ids=["alpha", "merge", "targets"],
)
def test_lora_flags_without_lora(fails, argv, culprit):
    fails(argv, culprit)


@pytest.fixture(scope="module")
def pristine_moe(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("pristine-moe") / "moe", moe=True)


def test_router_balance_loss_on_a_dense_model(fails):
    fails(["--moe.router_aux_loss", "on"], "--moe.router_aux_loss on", "dense")


@pytest.mark.parametrize("coef", ["-0.01", "nan", "0"])
def test_router_balance_coefficient_out_of_range(fails, tmp_path, pristine_moe, coef):
    moe = Path(shutil.copytree(pristine_moe, tmp_path / "moe"))
    fails(
        ["--hf-model", str(moe), "--moe.router_aux_loss", "on", "--moe.router_aux_loss_coef", coef],
        f"--moe.router_aux_loss_coef {float(coef)}", "expected a positive number",
    )  # fmt: skip


def test_router_balance_flag_without_the_loss(fails, tmp_path, pristine_moe):
    moe = Path(shutil.copytree(pristine_moe, tmp_path / "moe"))
    fails(
        ["--hf-model", str(moe), "--moe.router_aux_loss_scope", "global_batch"],
        "--moe.router_aux_loss_scope global_batch", "balance loss is off", "--moe.router_aux_loss on",
    )  # fmt: skip


def test_router_balance_coefficient_in_config_json(fails, tmp_path, pristine_moe):
    moe = Path(shutil.copytree(pristine_moe, tmp_path / "moe"))
    config = json.loads((moe / "config.json").read_text())
    (moe / "config.json").write_text(
        json.dumps({**config, "output_router_logits": True, "router_aux_loss_coef": -1.0})
    )
    fails(
        ["--hf-model", str(moe)],
        f"{moe}/config.json: router_aux_loss_coef -1.0",
        "expected a positive number",
    )


def test_router_balance_loss_with_tensor_parallelism(fails, tmp_path, pristine_moe):
    moe = Path(shutil.copytree(pristine_moe, tmp_path / "moe"))
    fails(
        ["--hf-model", str(moe), "--moe.router_aux_loss", "on", "--nproc", "2",
         "--parallelism.tensor_parallel_degree", "2", "--training.disable_cuda_graphs"],
        "--parallelism.tensor_parallel_degree 2", "router balance loss",
    )  # fmt: skip


def test_debug_layers_beyond_the_model(fails, tmp_path):
    fails(["--debug.layers", "5"], "--debug.layers 5", "expected 1 to the model's 4 decoder layers")


def test_debug_layers_of_a_model_directory(tmp_path, monkeypatch, capfd):
    # Its architecture (vocabulary 8,192) and tokenizer, its first layer only, random weights: every rank check
    # passes (the folder's weights are not read; the loss splits logits by the folder's vocabulary).
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("QWEN3_TITAN_DEVICE", "cpu")
    saved = dict(os.environ)
    model = make_tiny_checkpoint(tmp_path / "model", vocab_size=8192)
    args = ["--hf-model", str(model), "--debug.layers", "1", "--dump_folder", str(tmp_path / "out")]
    try:
        assert checks_in_process(BACKEND, args) == 0, capfd.readouterr()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_expert_capacity_without_expert_parallelism(fails, tmp_path):
    moe = make_tiny_checkpoint(tmp_path / "moe", moe=True)
    fails(
        ["--hf-model", str(moe), "--moe.capacity_factor", "2"],
        "--moe.capacity_factor 2.0",
        "only expert parallelism",
    )


def test_expert_capacity_no_one_means(fails, tmp_path):
    moe = make_tiny_checkpoint(tmp_path / "moe", moe=True)
    args = ["--hf-model", str(moe), "--nproc", "2", "--parallelism.expert_parallel_degree", "2"]
    fails([*args, "--moe.capacity_factor", "0"], "--moe.capacity_factor 0.0", "expected a positive number")


def test_expert_parallel_needs_no_flag_beyond_its_degree(fails, tmp_path, monkeypatch, capfd):
    # torchtitan refuses EP > 1 with CUDA graphs on, whatever the device, once the MoE model is in the config;
    # without a CUDA device (or with EP on one) the run is eager without --training.disable_cuda_graphs.
    monkeypatch.chdir(tmp_path)
    moe = make_tiny_checkpoint(tmp_path / "moe", moe=True)
    args = ["--hf-model", str(moe), "--nproc", "2", "--parallelism.expert_parallel_degree", "2"]
    assert checks_in_process(BACKEND, [*args, "--dump_folder", str(tmp_path / "out")]) == 0, (
        capfd.readouterr()
    )


# -- other run flags ---------------------------------------------------------------------------


def test_override_import_missing(fails):
    fails(["--override.imports", "no_such_kernels.rope"], "--override.imports no_such_kernels.rope")


def test_shard_size_not_a_size(fails):
    fails(["--hf.max_shard_size", "lots"], "--hf.max_shard_size 'lots'")


def test_export_interval_negative(fails):
    fails(["--hf.export_interval", "-1"], "--hf.export_interval -1")


def test_assets_without_tokenizer(fails, tmp_path):
    (tmp_path / "assets").mkdir()
    fails(["--hf_assets_path", str(tmp_path / "assets")], "hf_assets_path", "no tokenizer.json")


def test_tokenizer_file_corrupt(fails, tmp_path):
    _write((tmp_path / "assets").mkdir() or tmp_path / "assets" / "tokenizer.json", "{not json")
    fails(["--hf_assets_path", str(tmp_path / "assets")], "tokenizer.json", "not a readable tokenizer")


def test_tokenizer_larger_than_the_vocabulary(fails, tmp_path):
    small = make_tiny_checkpoint(tmp_path / "small", vocab_size=1024)
    fails(["--hf-model", str(small)], "4096 tokens", "vocab_size 1024")


# -- data --------------------------------------------------------------------------------------


def _data(fails, path: Path, *culprit, extra=()):
    return fails(["--dataloader.dataset", str(path), *extra], *culprit)


def test_data_missing(fails, tmp_path):
    _data(fails, tmp_path / "nowhere.jsonl", "nowhere.jsonl", "no such file")


def test_data_unsupported_suffix(fails, tmp_path):
    _data(fails, _write(tmp_path / "d.csv", "a,b\n"), "d.csv", "unsupported file type '.csv'")


def test_data_directory_without_data_files(fails, tmp_path):
    (tmp_path / "dir").mkdir()
    _write(tmp_path / "dir" / "notes.txt", "x")
    _data(fails, tmp_path / "dir", "holds no .jsonl", "notes.txt")


def test_data_empty_file(fails, tmp_path):
    _data(fails, _write(tmp_path / "d.jsonl", "\n\n"), "d.jsonl", "no records")


def test_data_gzip_named_jsonl(fails, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(gzip.compress((GOOD + "\n").encode()))
    _data(fails, path, "d.jsonl", "gzip-compressed", "gunzip")


def test_data_binary_named_jsonl(fails, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(bytes(range(256)) * 4)
    _data(fails, path, "d.jsonl", "binary file")


@pytest.mark.parametrize(
    ("codec", "named"),
    [("utf-16", "is UTF-16 text"), ("utf-16-le", "is UTF-16LE text"), ("utf-32", "is UTF-32 text")],
    ids=["utf-16-with-mark", "utf-16le-without", "utf-32"],
)
def test_data_in_another_unicode_encoding(fails, tmp_path, codec, named):
    path = tmp_path / "d.jsonl"
    path.write_bytes((GOOD + "\n").encode(codec) * 3)
    _data(fails, path, "d.jsonl", named, "not UTF-8", "iconv -f")


def test_data_in_latin1(fails, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(
        (json.dumps({"text": "Café au lait, crème brûlée."}, ensure_ascii=False) + "\n").encode("latin-1") * 3
    )
    _data(fails, path, "d.jsonl", "is not UTF-8 text (byte 0xe9 at offset 13", "iconv -f LATIN1 -t UTF-8")


def test_data_json_array_named_jsonl(fails, tmp_path):
    _data(fails, _write(tmp_path / "d.jsonl", json.dumps([{"text": "a"}])), "d.jsonl", "JSON array")


def test_data_pretty_printed_json(fails, tmp_path):
    path = _write(tmp_path / "d.json", json.dumps({"rows": [{"text": "a"}]}, indent=2))
    _data(fails, path, "d.json", "is not JSON Lines")


def test_data_parquet_truncated(fails, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["some text"] * 50}), path)
    path.write_bytes(path.read_bytes()[:-20])
    _data(fails, path, "d.parquet", "not a readable Parquet file")


def test_data_parquet_named_jsonl(fails, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "d.jsonl")
    _data(fails, tmp_path / "d.jsonl", "d.jsonl", "is a Parquet file")


@pytest.mark.parametrize(
    ("line", "culprit"),
    [
        ('{"text": "unterminated', "line is not JSON"),
        (json.dumps({"body": "x"}), "field 'text' missing"),
        (json.dumps({"text": 42}), "field 'text' is a number"),
        (json.dumps({"text": "  "}), "field 'text' is empty"),
    ],
    ids=["not-json", "missing-field", "wrong-type", "empty-text"],
)
def test_data_bad_first_records(fails, tmp_path, line, culprit):
    path = _write(tmp_path / "d.jsonl", "\n".join([GOOD, GOOD, line, GOOD]) + "\n")
    _data(fails, path, "d.jsonl:3", culprit, "--dataloader.on_bad_record skip")


@pytest.mark.parametrize(
    ("line", "culprit"),
    [
        (json.dumps({"messages": [{"role": "user", "content": "Hi?"}]}), "no assistant turn"),
        (json.dumps({"messages": "Hi"}), "field 'messages' is a string"),
    ],
    ids=["no-assistant", "messages-not-a-list"],
)
def test_data_bad_first_chat_records(fails, tmp_path, line, culprit):
    path = _write(tmp_path / "chat.jsonl", "\n".join([GOOD_CHAT, line]) + "\n")
    _data(fails, path, "chat.jsonl:2", culprit)


def test_data_not_utf8(fails, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes((GOOD + "\n").encode() + b'{"text": "caf\xe9"}\n')
    _data(fails, path, "d.jsonl:2", "not UTF-8")


def test_data_record_over_the_size_limit(fails, tmp_path):
    path = _write(tmp_path / "d.jsonl", GOOD + "\n" + json.dumps({"text": "x" * 5000}) + "\n")
    _data(fails, path, "d.jsonl:2", "over the 1,000 bytes limit", "--dataloader.max_record_bytes",
          extra=["--dataloader.max_record_bytes", "1000"])  # fmt: skip


def test_data_size_limit_not_positive(fails, tmp_path):
    path = _write(tmp_path / "d.jsonl", GOOD + "\n")
    _data(fails, path, "--dataloader.max_record_bytes 0", extra=["--dataloader.max_record_bytes", "0"])


def test_data_every_record_bad_when_skipping(fails, tmp_path):
    path = _write(tmp_path / "d.jsonl", json.dumps({"body": 1}) + "\n" + json.dumps({"body": 2}) + "\n")
    extra = ["--dataloader.on_bad_record", "skip", "--dataloader.format", "text"]
    _data(fails, path, "no usable record", "d.jsonl:1", extra=extra)


def test_data_fields_neither_text_nor_chat(fails, tmp_path):
    path = _write(tmp_path / "d.jsonl", json.dumps({"body": 1}) + "\n")
    _data(fails, path, "d.jsonl:1", "neither field 'messages' (chat) nor 'text'", "(fields: body)")


def test_data_dataset_path_flag(fails, tmp_path):
    fails(["--dataloader.dataset_path", str(tmp_path)], "--dataloader.dataset_path", "--dataloader.dataset")


def test_data_split_missing(fails, tmp_path):
    (tmp_path / "dir").mkdir()
    _write(tmp_path / "dir" / "train.jsonl", GOOD + "\n")
    _write(tmp_path / "dir" / "test.jsonl", GOOD + "\n")
    _data(fails, tmp_path / "dir", "no split 'validation'", extra=["--dataloader.split", "validation"])


def test_data_chat_format_on_text_records(fails, tmp_path):
    path = _write(tmp_path / "d.jsonl", GOOD + "\n")
    _data(fails, path, "d.jsonl", "'messages'", extra=["--dataloader.format", "chat"])


def test_data_saved_dataset_damaged(fails, tmp_path):
    from datasets import Dataset

    saved = tmp_path / "saved"
    Dataset.from_dict({"text": ["a b c"] * 20}).save_to_disk(str(saved))
    for arrow in saved.glob("*.arrow"):
        arrow.write_bytes(arrow.read_bytes()[:64])
    _data(fails, saved, "saved", "does not load")


# -- the Hugging Face model directory --------------------------------------------------------------


def _rewrite_header(path: Path, change) -> None:
    """Rewrite a safetensors file's JSON header with ``change(header)``, keeping its data bytes."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])


def _retensor(model: Path, change) -> None:
    tensors = load_file(model / "model.safetensors")
    change(tensors)
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})


def test_model_dir_missing(fails, tmp_path):
    fails(["--hf-model", str(tmp_path / "nowhere")], "nowhere", "no such directory")


def test_lora_adapter_missing(fails, tmp_path):
    fails(
        ["--lora.adapter", str(tmp_path / "nowhere")],
        "--lora.adapter",
        "nowhere",
        "no adapter_config.json there",
    )


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("Qwen/Qwen3-0.6B", "hf download Qwen/Qwen3-0.6B --local-dir DIR"),
        ("hf://Qwen/Qwen3-0.6B", "hf download Qwen/Qwen3-0.6B --local-dir DIR"),
        ("s3://bucket/qwen3", "aws s3 cp --recursive s3://bucket/qwen3 DIR"),
    ],
    ids=["hub-id", "hf-scheme", "s3"],
)
def test_model_dir_remote_names_keep_their_form(fails, name, hint):
    fails(["--hf-model", name], f"--hf.model_dir {name}:", hint)


def test_model_dir_is_a_file(fails, model):
    fails(["--hf-model", str(model / "model.safetensors")], "model.safetensors", "is a file, not a directory")


def test_model_dir_without_config(fails, model):
    (model / "config.json").unlink()
    fails(["--hf-model", str(model)], "config.json")


def test_model_dir_config_not_json(fails, model):
    _write(model / "config.json", "{oops")
    fails(["--hf-model", str(model)], "config.json")


def test_model_dir_unsupported_rope_scaling(fails, model):
    config = json.loads((model / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "dynamic", "factor": 4.0}
    _write(model / "config.json", json.dumps(config))
    fails(["--hf-model", str(model)], "rope_scaling")


def test_model_dir_missing_a_layer(fails, model):
    _retensor(model, lambda t: [t.pop(k) for k in [k for k in t if k.startswith("model.layers.1.")]])
    fails(["--hf-model", str(model)], "missing 11", "model.layers.1.")


def test_model_dir_extra_key(fails, model):
    _retensor(model, lambda t: t.update({"model.extra.weight": torch.ones(2)}))
    fails(["--hf-model", str(model)], "unexpected 1: model.extra.weight")


def test_model_dir_shape_mismatch(fails, model):
    _retensor(model, lambda t: t.update({"model.norm.weight": torch.ones(65)}))
    fails(["--hf-model", str(model)], "model.norm.weight (expected [64], found [65])")


def test_model_dir_truncated_weights(fails, model):
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    fails(["--hf-model", str(model)], "model.safetensors", "truncated")


def test_model_dir_garbage_weights(fails, model):
    (model / "model.safetensors").write_bytes(b"\x00\x01" * 100)
    fails(["--hf-model", str(model)], "model.safetensors", "corrupt")


def test_model_dir_index_names_a_missing_shard(fails, tmp_path):
    sharded = make_tiny_checkpoint(tmp_path / "sharded", max_shard_size="100KB")
    shard = sorted(sharded.glob("model-*.safetensors"))[-1]
    shard.unlink()
    fails(["--hf-model", str(sharded)], shard.name, "missing")


def test_model_dir_tensor_in_two_shards(fails, tmp_path):
    sharded = make_tiny_checkpoint(tmp_path / "sharded", max_shard_size="100KB")
    first, last = (
        sorted(sharded.glob("model-*.safetensors"))[0],
        sorted(sharded.glob("model-*.safetensors"))[-1],
    )
    stray_key = next(iter(load_file(first)))
    tensors = load_file(last)
    tensors[stray_key] = torch.zeros_like(load_file(first)[stray_key])  # another value under the same name
    save_file(tensors, last, metadata={"format": "pt"})
    fails(["--hf-model", str(sharded)], last.name, f"'{stray_key}'", first.name, "stores each tensor once")


def test_model_dir_tied_with_a_distinct_lm_head(fails, model):
    # config.json ties them; the file holds an lm_head of its own, which transformers would load as it is.
    _retensor(model, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1.0}))
    fails(["--hf-model", str(model)], "'lm_head.weight' differs", "tie_word_embeddings true")


def test_model_dir_pickle_weights_only(fails, model):
    (model / "model.safetensors").unlink()
    torch.save({"w": torch.zeros(1)}, model / "pytorch_model.bin")
    fails(["--hf-model", str(model)], "pytorch_model.bin", "never loaded")


@pytest.mark.parametrize(
    ("dtype", "shown"), [(torch.int8, "int8"), (torch.bool, "bool"), (torch.float8_e4m3fn, "float8_e4m3fn")]
)
def test_model_dir_non_floating_weights(fails, model, dtype, shown):
    key = "model.layers.0.mlp.up_proj.weight"
    _retensor(model, lambda t: t.update({key: t[key].to(dtype)}))
    fails(["--hf-model", str(model)], f"'{key}' is {shown} on disk", "floating-point")


def test_model_dir_offsets_do_not_match_the_shape(fails, model):
    key = "model.norm.weight"

    def change(header):
        header[key]["shape"] = [32]  # 64 floats on disk

    _rewrite_header(model / "model.safetensors", change)
    fails(["--hf-model", str(model)], f"tensor '{key}'", "shape [32] x F32 is 128 bytes", "span 256")


# -- what the user owns is never overwritten -------------------------------------------------------


def test_export_dir_is_the_model_dir(fails, model):
    fails(["--hf-model", str(model), "--hf.export_dir", str(model)], "is the model directory being trained")


def test_export_dir_contains_the_model_dir(fails, tmp_path):
    # The case: exports to the model's parent replaced it (step-30/) and deleted its README.
    source = make_tiny_checkpoint(tmp_path / "models" / "step-30")
    _write(source / "README.md", "my notes")
    fails(
        ["--hf-model", str(source), "--hf.export_dir", str(tmp_path / "models"), "--training.steps", "30"],
        "contains the model directory being trained",
    )  # fmt: skip


def test_export_dir_inside_the_model_dir(fails, model):
    fails(
        ["--hf-model", str(model), "--hf.export_dir", str(model / "exports")],
        "lies inside the model directory",
    )


def test_dump_folder_is_the_model_dir(fails, model):
    fails(["--hf-model", str(model), "--hf.export_dir", "elsewhere", "--dump_folder", str(model)],
          "--dump_folder", "is the model directory being trained", dump=False)  # fmt: skip


def test_export_dir_holds_foreign_files(fails, tmp_path):
    (tmp_path / "mine").mkdir()
    _write(tmp_path / "mine" / "README.md", "keep me")
    fails(["--hf.export_dir", str(tmp_path / "mine")], "did not write (README.md)")


def test_export_dir_holds_a_step_dir_without_the_marker(fails, tmp_path):
    (tmp_path / "out" / "hf" / "step-30").mkdir(parents=True)
    _write(tmp_path / "out" / "hf" / "step-30" / "model.safetensors", "mine")
    fails([], "the export directory", "did not write (step-30)")


def test_export_dir_is_the_checkpoint_folder(fails, tmp_path):
    fails(["--hf.export_dir", str(tmp_path / "out" / "checkpoint")], "the checkpoint folder")


def test_export_dir_is_a_file(fails, tmp_path):
    _write(tmp_path / "exports", "x")
    fails(["--hf.export_dir", str(tmp_path / "exports")], "exports", "is a file")


def test_dump_folder_is_a_file(fails, tmp_path):
    _write(tmp_path / "out", "x")
    fails([], "--dump_folder", "is a file, not a directory")


def test_dump_folder_under_a_file(fails, tmp_path):
    _write(tmp_path / "afile", "x")
    fails(["--dump_folder", str(tmp_path / "afile" / "run")], "afile is a file", dump=False)


def test_dump_folder_in_use_by_another_run(fails, tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from qwen3_titan_common.train.dump_lock import DumpFolderLock; "
         f"lock = DumpFolderLock({str(tmp_path / 'out')!r}); lock.acquire(); print('held', flush=True); "
         "time.sleep(120)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        fails([], "in use by another training run", f"(PID {holder.pid})")
    finally:
        holder.kill()
        holder.wait()


def test_dump_folder_lock_is_released_when_its_holder_dies(tmp_path):
    lock = DumpFolderLock(tmp_path / "out")
    lock.acquire()
    lock.release()
    again = DumpFolderLock(tmp_path / "out")
    again.acquire()  # no error: a lock file alone does not block
    again.release()


def _checkpoint_of(folder: Path, record: dict, step: int = 5) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.zeros(2)}, checkpoint_id=str(folder / f"step-{step}"))
    write_model_record(folder, record)


def test_dump_folder_holds_checkpoints_of_another_model(fails, tmp_path, model):
    from qwen3_titan_common.assets import default_architecture

    _checkpoint_of(tmp_path / "out" / "checkpoint", model_record("qwen3", default_architecture()))
    fails(
        ["--hf-model", str(model)],
        "its checkpoints (newest: step 5",
        "another model",
        "hidden_size 256 there, 64 here",
    )


def test_dump_folder_holds_checkpoints_of_another_backend(fails, tmp_path):
    from qwen3_titan_common.assets import default_architecture

    _checkpoint_of(tmp_path / "out" / "checkpoint", model_record("hf_v5", default_architecture()))
    fails([], "another model", "model hf_v5 there, qwen3 here")


def test_dump_folder_holds_a_per_rank_data_position(fails, tmp_path):
    # Written before one packed stream was dealt to every layout: same model, no data_position in its record.
    from qwen3_titan_common.assets import default_architecture
    from qwen3_titan_common.components.model_record import schedule_of
    from qwen3_titan_native.config_registry import debug

    _checkpoint_of(
        tmp_path / "out" / "checkpoint", model_record("qwen3", default_architecture(), schedule_of(debug()))
    )
    fails([], "checkpoint/step-5: its data position is a per-rank share", "new --dump_folder")


@pytest.mark.parametrize(
    ("started_live", "flags", "culprit"),
    [
        (True, [], "hold the starting weights of a live preference reference"),
        (False, ["--dpo.reference", "live"], "hold no live reference's weights"),
    ],
    ids=["live-resumed-precomputed", "precomputed-resumed-live"],
)
def test_dump_folder_holds_the_other_kind_of_preference_reference(
    fails, tmp_path, started_live, flags, culprit
):
    from qwen3_titan_common.assets import default_architecture

    record = model_record("qwen3", default_architecture(), live_reference=started_live)
    _checkpoint_of(tmp_path / "out" / "checkpoint", record)
    fails(["--objective", "dpo", "--dataloader.dataset", "default-pairs", *flags], culprit, "--dump_folder")


def test_interrupted_before_any_rank(tmp_path):
    """Ctrl-C while the launcher parses and checks: one line, exit 130, nothing written."""
    import signal
    import time

    train = str(Path(sys.executable).with_name("train"))
    env = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": "native-backend"}
    before = snapshot(tmp_path)
    proc = subprocess.Popen([train, "--dump_folder", str(tmp_path / "out")], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    # The launcher names the backend just before it starts parsing and checking (which takes seconds:
    # torchtitan's import alone), so a slow machine's interpreter start-up cannot beat the signal.
    first_line = proc.stderr.readline()
    assert first_line.startswith("[train] backend:"), first_line
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    check_failure(proc.returncode, out, first_line + err, 130, "interrupted before any rank started")
    assert changes(before, snapshot(tmp_path)) == []


# -- values no one means, the same rule everywhere ----------------------------------------------


@pytest.mark.parametrize(
    ("argv", "culprit"),
    [
        (["--training.max_norm", "-1"], "--training.max_norm -1.0: expected a positive number"),
        (["--training.max_norm", "0"], "--training.max_norm 0.0: expected a positive number"),
        (["--warmup", "-1"], "--lr_scheduler.warmup_steps -1 (--warmup): expected an integer >= 0"),
        (["--decay", "1.5"], "--lr_scheduler.decay_ratio 1.5 (--decay): expected a fraction in [0, 1]"),
        (["--lr_scheduler.min_lr_factor", "2"], "--lr_scheduler.min_lr_factor 2.0: expected a fraction"),
        (["--dataloader.prefetch_factor", "4"], "--dataloader.prefetch_factor 4: applies only to loader worker"),
        (["--dataloader.persistent_workers"], "--dataloader.persistent_workers True: applies only"),
        (["--dataloader.num_workers", "-1"], "--dataloader.num_workers -1: expected an integer >= 0"),
        (["--metrics.log_freq", "0"], "--metrics.log_freq 0: expected a positive integer"),
        (["--metrics.progress_seconds", "-1"], "--metrics.progress_seconds -1.0: expected seconds, 0 or more"),
        (["--training.global_batch_size", "12"],
         "--training.global_batch_size 12: expected a multiple of --training.local_batch_size (--batch-size) 8 "
         "x 1 data-parallel rank(s) = 8"),
        (["--nproc", "2", "--training.global_batch_size", "8"], "x 2 data-parallel rank(s) = 16"),
    ],
    ids=["clip-negative", "clip-zero", "warmup-negative", "decay-over-one", "min-lr-over-one",
         "prefetch-without-workers", "persistent-without-workers", "workers-negative", "log-freq-zero", "progress-negative",
         "global-batch-not-a-multiple", "global-batch-below-the-ranks"],
)  # fmt: skip
def test_schedule_and_loader_values_no_one_means(fails, argv, culprit):
    fails(argv, culprit)


@pytest.fixture
def passes(tmp_path, monkeypatch, capfd):
    """What ``train ARGV`` checks before anything is written accepts ARGV."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("QWEN3_TITAN_DEVICE", "cpu")
    saved = dict(os.environ)

    def _passes(argv):
        code = checks_in_process(BACKEND, [*argv, "--dump_folder", str(tmp_path / "out")])
        assert code == 0, capfd.readouterr().err

    yield _passes
    os.environ.clear()
    os.environ.update(saved)


def test_no_clipping_is_inf(passes):
    passes(["--training.max_norm", "inf"])


def test_misspelled_short_flag_names_the_one_meant(fails):
    line = fails(["--stpes", "3"], "--stpes: not a flag of this config", "perhaps you meant --steps")
    assert ", 3" not in line  # the stray value is not reported as a second unknown flag


def test_empty_dump_folder(fails):
    fails(["--out", ""], "--dump_folder (--out) is empty", dump=False)


def test_dump_folder_inside_the_data_folder(fails, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    _write(data / "train.jsonl", GOOD + "\n")
    for out in (data, data / "run"):
        fails(["--dataloader.dataset", str(data), "--out", str(out)], "inside the data folder", dump=False)


def test_rope_scaling_written_as_plain_rope_is_accepted(passes, model):
    config = json.loads((model / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "default"}
    _write(model / "config.json", json.dumps(config))
    passes(["--hf-model", str(model)])


def test_model_dir_names_another_model_class(fails, model):
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    _write(model / "config.json", json.dumps(config))
    fails(
        ["--hf-model", str(model)], "config.json", "'architectures'=['LlamaForCausalLM']", "Qwen3ForCausalLM"
    )


def test_resume_with_fewer_steps_than_the_checkpoint(fails, tmp_path):
    from qwen3_titan_common.assets import default_architecture
    from qwen3_titan_common.components.model_record import schedule_of
    from qwen3_titan_common.data.loader import POSITION_FORMAT
    from qwen3_titan_native.config_registry import debug

    record = model_record("qwen3", default_architecture(), schedule_of(debug()), POSITION_FORMAT)
    _checkpoint_of(tmp_path / "out" / "checkpoint", record)
    fails(["--steps", "3"], "--training.steps 3 (--steps): the newest checkpoint", "at step 5", "above 5")


@pytest.mark.parametrize(
    ("argv", "culprit"),
    [
        (["--stpes", "3"], "--stpes: not a flag of this config"),
        (["--lr", "-1"], "lr -1.0 (--lr): expected a number >= 0"),
        (["--dataloader.dataset", "nowhere.jsonl"], "nowhere.jsonl': no such file"),
        (["--dry-run"], "--print-sbatch and --dry-run both given"),
        (["--nnodes", "2", "--parallelism.tensor_parallel_degree", "3"], "does not divide"),
    ],
    ids=["misspelled", "lr-negative", "data-missing", "dry-run", "layout"],
)
def test_print_sbatch_checks_the_job_before_printing_it(fails, argv, culprit):
    line = fails(["--print-sbatch", "cpu", *argv], culprit, dump=False)
    assert "#!/bin/bash" not in line


@pytest.mark.parametrize(
    ("argv", "culprit"),
    [
        (["--print-cmd", "--memory-per-rank", "24"], "--memory-per-rank: not with --print-cmd"),
        (["--dry-run", "--memory-per-rank", "0"], "--memory-per-rank=0: expected a positive number of GiB"),
        (["--dry-run", "--memory-per-rank", "lots"], "--memory-per-rank=lots"),
    ],
    ids=["beside-print-cmd", "zero", "not-a-number"],
)
def test_memory_per_rank_is_a_dry_run_amount(fails, argv, culprit):
    fails(argv, culprit)


def _half_a_gib_above_this_process() -> str:
    """A stated memory half a GiB above what this process holds (a job here counts its process's own memory):
    64 rows of the debug model (~2 GiB of step) do not fit it, one row (~0.06 GiB) does."""
    from qwen3_titan_common.perf.memory import GIB, process_baseline_bytes

    return f"{process_baseline_bytes('cpu') / GIB + 0.5:.2f}"


def test_a_job_that_does_not_fit_a_stated_memory_is_refused_with_settings_that_fit(fails):
    # The CPU twin of a device smaller than this machine.
    memory = _half_a_gib_above_this_process()
    line = fails(["--dry-run", "--batch-size", "64", "--memory-per-rank", memory],
                 "--training.local_batch_size 64 (--batch-size)", "does not fit", f"(--memory-per-rank {float(memory):g})",
                 "fits by the same estimate")  # fmt: skip
    fits = re.search(r"--batch-size\) (\d+) \(~([0-9.]+) GiB\)", line)
    assert fits, line
    assert 1 <= int(fits.group(1)) < 64 and float(fits.group(2)) <= float(memory)


def test_a_run_that_does_not_fit_a_stated_memory_is_refused_before_torchrun(fails, tmp_path):
    # Not a dry run: the launcher checks before it starts torchrun, and nothing is written. The command names
    # its batch and its activation checkpointing, so the launcher has nothing of its own to choose.
    line = fails(["--batch-size", "64", "--memory-per-rank", _half_a_gib_above_this_process(), "--dump_folder",
                  str(tmp_path / "out"), "activation-checkpoint:none"],
                 "--training.local_batch_size 64 (--batch-size)", "does not fit", "fits by the same estimate",
                 dump=False)  # fmt: skip
    assert "torchrun" not in line


def test_a_stated_memory_below_the_process_itself_is_said_so(fails):
    # Nothing the launcher could change fits: not a smaller batch, not more ranks, and not LoRA, which this job
    # already trains (a hint to train LoRA adapters would be no answer).
    line = fails(["--dry-run", "--lora.rank", "8", "--memory-per-rank", "0.1"], "does not fit",
                 "the process alone holds ~", "no layout of this job fits")  # fmt: skip
    assert "LoRA" not in line


def test_dry_run_of_a_batch_this_machine_cannot_hold(fails):
    from qwen3_titan_common.perf.fit import available_host_bytes

    # The logits alone (fp32 copy and gradient, 4096-token vocabulary) outgrow this machine's memory.
    rows = max(64, int(4 * available_host_bytes() / (256 * 4096 * 8)) // 64 * 64)
    line = fails(["--dry-run", "--batch-size", str(rows)], f"--training.local_batch_size {rows} (--batch-size)",
                 "does not fit", "GiB per rank here (cpu:", "fits by the same estimate")  # fmt: skip
    fits = int(line.split("(--batch-size) ")[-1].split()[0])
    assert 1 <= fits < rows


def test_conversion_needs_weights_and_a_checkpoint_folder_without_steps(fails, tmp_path):
    fails(["--hf.to_dcp"], "--hf.to_dcp: converts --hf.model_dir (--hf-model DIR), and none is given")
    model = make_tiny_checkpoint(tmp_path / "model")
    fails(
        ["--hf-model", str(model), "--hf.to_dcp", "--checkpoint.no-enable"], "not with --checkpoint.no-enable"
    )
    (tmp_path / "out" / "checkpoint" / "step-4").mkdir(parents=True)
    fails(["--hf-model", str(model), "--hf.to_dcp"], "already holds step-4", "pass another --out")


# -- preference training ----------------------------------------------------------------------------


def test_dpo_on_text_records(fails):
    fails(["--objective", "dpo"], "--objective dpo: --dataloader.dataset 'default' holds text records")


def test_preference_pairs_without_dpo(fails):
    fails(
        ["--dataloader.dataset", "default-pairs"],
        "holds preference pairs ('chosen', 'rejected'): train them with --objective dpo",
        "--dataloader.format chat|text",
    )


def test_dpo_with_the_router_balance_loss(fails, tmp_path):
    moe = make_tiny_checkpoint(tmp_path / "moe", moe=True)
    fails(
        ["--objective", "dpo", "--dataloader.dataset", "default-pairs", "--hf-model", str(moe),
         "--moe.router_aux_loss", "on"],
        "--moe.router_aux_loss on: the router balance loss is not added to the preference loss",
    )  # fmt: skip


def test_validation_data_of_another_kind_than_training(fails, tmp_path):
    fails(
        ["--objective", "dpo", "--dataloader.dataset", "default-pairs", "--validator.enable",
         "--validator.dataloader.dataset", "default"],
        "--validator.dataloader.dataset 'default' holds text records, and the run trains on preference records",
    )  # fmt: skip
    fails(
        ["--validator.enable", "--validator.dataloader.dataset", "default-pairs"],
        "--validator.dataloader.dataset 'default-pairs' holds preference records, and the run trains on text",
    )  # fmt: skip


def test_dpo_values_no_one_can_mean(fails):
    fails(
        ["--objective", "dpo", "--dataloader.dataset", "default-pairs", "--dpo.beta", "0"], "--dpo.beta 0.0"
    )


def test_dpo_with_context_parallelism_over_flex_attention():
    """CUDA's default attention is torchtitan's Flex, whose context parallelism splits rows its own way; the
    preference loss finds a pair's tokens by ours. (The config is the debug one with CUDA's attention: the
    CPU cannot choose it.)"""
    import dataclasses

    from qwen3_titan_common.components.preference import loss_and_data_for_preference
    from qwen3_titan_common.errors import UserInputError
    from qwen3_titan_common.models.qwen3 import titan_qwen3_model_config
    from qwen3_titan_native.config_registry import debug

    config = debug()
    flex = titan_qwen3_model_config(config.architecture, attention="flex")
    with pytest.raises(
        UserInputError, match="--parallelism.context_parallel_degree 2: --objective dpo shares rows"
    ):
        loss_and_data_for_preference(
            config.loss, config.dataloader, config.dpo, objective="dpo", moe=config.moe,
            parallelism=dataclasses.replace(config.parallelism, context_parallel_degree=2), model_config=flex,
            device_type="cuda",
        )  # fmt: skip


def test_dpo_on_neuron_takes_fixed_shapes_and_refuses_them_off():
    """Neuron compiles a graph per input shape: preference training there has every tensor of its loss shaped
    by the rows alone (``auto``), and ``--dpo.fixed_shapes off`` is one line. (Neuron's device type is passed in:
    this machine has none; the fixed-shape loss itself runs here, ``test_dpo_train.py``.)"""

    from qwen3_titan_common.components.preference import PreferenceOptions, loss_and_data_for_preference
    from qwen3_titan_common.errors import UserInputError
    from qwen3_titan_native.config_registry import debug

    config = debug()

    def loss(options, device_type):
        return loss_and_data_for_preference(
            config.loss, config.dataloader, options, objective="dpo", moe=config.moe,
            parallelism=config.parallelism, model_config=config.model_spec.model, device_type=device_type,
        )[0]  # fmt: skip

    assert loss(config.dpo, "neuron").fixed_shapes
    assert not loss(config.dpo, "cpu").fixed_shapes
    with pytest.raises(UserInputError, match="--dpo.fixed_shapes off: the loss would select each batch's"):
        loss(PreferenceOptions(fixed_shapes="off"), "neuron")
