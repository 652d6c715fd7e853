"""``eval``: the loss of a real tiny checkpoint, checked against transformers; bad input is one line."""

import json
import math

import pytest
import torch
from qwen3_titan_common.data.validation import ValidationDataLoader
from qwen3_titan_common.scripts.eval import main
from qwen3_titan_common.train.tolerance import ModelBounds
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from transformers import AutoModelForCausalLM


@pytest.fixture(autouse=True)
def on_cpu(monkeypatch):
    # The same device on every host, so figures compare with transformers on the CPU.
    monkeypatch.setenv("QWEN3_TITAN_DEVICE", "cpu")


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("dense") / "ckpt", max_shard_size="60KB")


@pytest.fixture(scope="module")
def other_vocab(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("other-vocab") / "ckpt", vocab_size=4160)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("moe") / "ckpt", moe=True, tied=False)


def _report(capsys, *argv) -> dict:
    assert main([*map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _transformers_loss(path, seq_len, batches) -> tuple[float, int]:
    """transformers' loss over the rows eval reads (the held-out part of the embedded corpus), each document
    scored alone: per-document positions, no attention mask, no cache (transformers' packed sequences)."""
    tokenizer = HuggingFaceTokenizer(tokenizer_path=str(path))
    config = ValidationDataLoader.Config(dataset="default", split="train", records="held_out")
    loader = config.build(
        dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=seq_len, local_batch_size=4
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for _, (inputs, labels) in zip(range(batches), loader, strict=False):
            logits = model(inputs["input"], position_ids=inputs["positions"], use_cache=False).logits
            total += torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            ).item()
            tokens += int((labels != IGNORE_INDEX).sum())
    return total / tokens, tokens


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_loss_is_transformers_loss_on_the_held_out_rows(capsys, request, kind):
    path = request.getfixturevalue(kind)
    report = _report(capsys, path, "--seq-len", 64, "--batch-size", 4, "--max-batches", 3)
    (result,) = report["results"]
    expected, tokens = _transformers_loss(path, 64, 3)
    assert result["tokens"] == tokens == 3 * 4 * 64
    # Two fp32 implementations of one model on the same rows: the derived bound of their mean loss.
    bound = ModelBounds.from_dir(path).loss_atol(expected, tokens=tokens, seq_len=64)
    assert abs(result["loss"] - expected) <= bound
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))
    assert report["data"] == "the held-out part of the embedded corpus"
    assert report["device"] == "cpu" and report["model"] == "torchtitan Qwen3"


def test_the_loss_does_not_depend_on_the_batch_size(capsys, tmp_path, dense):
    data = tmp_path / "eval.jsonl"
    data.write_text(
        "".join(json.dumps({"text": f"Record {i}: " + "some words " * i}) + "\n" for i in range(40))
    )
    by_batch = [
        _report(capsys, dense, "--dataset", data, "--seq-len", 32, "--batch-size", b)["results"][0]
        for b in (8, 3)
    ]
    # Every token of the file is scored, padding rows are not: 40 documents, packed, each ending in EOS.
    assert by_batch[0]["tokens"] == by_batch[1]["tokens"] > 40 * 5
    assert by_batch[0]["rows"] % 8 == 0 and by_batch[1]["rows"] % 3 == 0
    # One model on rows batched another way (other matmul shapes, other sums): the derived bound.
    loss, tokens = by_batch[1]["loss"], by_batch[1]["tokens"]
    bound = ModelBounds.from_dir(dense).loss_atol(loss, tokens=tokens, seq_len=32)
    assert abs(by_batch[0]["loss"] - loss) <= bound


def test_random_init_row_sits_near_ln_vocab(capsys, dense):
    report = _report(capsys, dense, "--random-init", "--seq-len", 64, "--max-batches", 2)
    checkpoint, random_init = report["results"]
    assert random_init["model"] == "random init (seed 0)"
    assert random_init["tokens"] == checkpoint["tokens"]
    assert abs(random_init["loss"] - math.log(4096)) < 0.1
    assert report["ln_vocab"] == pytest.approx(math.log(4096))


def test_table_output(capsys, dense):
    assert main([str(dense), "--seq-len", "64", "--max-batches", "1", "--random-init"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(
        f"{dense}: torchtitan Qwen3 on cpu (float32), 8 rows of 64 tokens of the held-out part"
    )
    assert out[2] == "| model | loss | perplexity | tokens | tokens/s |"
    assert out[4].startswith(f"| {dense} | ") and out[5].startswith("| random init (seed 0) | ")


def _hub_adapter(path, base_dir):
    """A well-formed peft adapter of ``base_dir``'s architecture that names a hub model as its base."""
    from qwen3_titan_common.arch.architecture import read_architecture
    from qwen3_titan_common.hf.adapter import AdapterSpec, expected_adapter_shapes, write_adapter_dir
    from qwen3_titan_common.models.lora import LoRAParams

    targets = ("q_proj", "v_proj")
    shapes = expected_adapter_shapes(read_architecture(base_dir), targets, 2)
    spec = AdapterSpec(path, LoRAParams(rank=2, alpha=4.0, dropout=0.0), targets, "Qwen/Qwen3-0.6B", step=1)
    return write_adapter_dir(spec, {key: torch.zeros(shape) for key, shape in shapes.items()})


def _without_tokenizer(path, model_dir):
    """A copy of ``model_dir``'s config and weights alone."""
    path.mkdir()
    for source in [model_dir / "config.json", *model_dir.glob("model*.safetensors*")]:
        (path / source.name).write_bytes(source.read_bytes())
    return path


def test_a_model_without_tokenizer_files_takes_the_one_named(capsys, tmp_path, dense):
    bare = _without_tokenizer(tmp_path / "bare", dense)
    named = _report(capsys, bare, "--tokenizer", dense, "--seq-len", "64", "--max-batches", "1")
    default = _report(capsys, bare, "--tokenizer", "default", "--seq-len", "64", "--max-batches", "1")
    own = _report(capsys, dense, "--seq-len", "64", "--max-batches", "1")
    # The tiny checkpoint carries the embedded tokenizer: the same ids, the same loss.
    assert named["results"][0]["loss"] == default["results"][0]["loss"] == own["results"][0]["loss"]
    assert named["tokenizer"] == str(dense)


def _listing(*roots):
    return {str(p): p.stat().st_mtime_ns for root in roots for p in root.rglob("*")}


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["{missing}"], "model directory {missing}: no such directory"),
        (["{empty}"], "config.json"),
        (
            ["{dense}", "--dataset", "{missing}"],
            "--dataset '{missing}': no such file or directory",
        ),
        (["{dense}", "--seq-len", "4096"], "--seq-len 4096: longer than the model's max_position_embeddings"),
        (["{untokenized}"], "no tokenizer files (tokenizer.json) beside the model; pass --tokenizer DIR"),
        (["{dense}", "--tokenizer", "{empty}"], "--tokenizer {empty}: no tokenizer.json there"),
        (
            ["{dense}", "--records", "held_out", "--held-out", "0", "--dataset", "{bad_record}"],
            "no held-out records for validation (--held-out is 0); pass --dataset PATH, a --held-out share",
        ),
        (["{dense}", "--backend", "nope"], "--backend nope: not an installed backend"),
        (["{dense}", "--seq-len", "0"], "--seq-len 0: expected a positive integer"),
        (
            ["{dense}", "--dataset", "{bad_record}"],
            "bad.jsonl:2: field 'text' is a number (expected a string) (fix it, or pass --on-bad-record skip",
        ),
        (
            ["{hub_adapter}"],
            "base_model_name_or_path 'Qwen/Qwen3-0.6B': not a local directory; pass --base DIR",
        ),
        (["{dense}", "--base", "{dense}"], "is a model directory, not a peft adapter; drop --base"),
        (
            ["{dense}", "--dataset", "{pairs}"],
            "holds preference pairs: their DPO loss compares the model with the one training started from; "
            "pass that as --reference DIR",
        ),
        (["{dense}", "--reference", "{dense}"], "--reference {dense}: a reference scores preference pairs"),
        (
            ["{dense}", "--dataset", "{pairs}", "--reference", "{missing}"],
            "--reference {missing}: no such directory",
        ),
        (
            ["{dense}", "--dataset", "{pairs}", "--reference", "{dense}", "--random-init"],
            "--random-init: scores text and chat data; drop it with preference pairs",
        ),
        (
            ["{dense}", "--dataset", "{pairs}", "--reference", "{dense}", "--dpo.beta", "0"],
            "--dpo.beta 0.0: expected a positive number",
        ),
        (
            ["{dense}", "--dataset", "{pairs}", "--reference", "{hub_adapter}"],
            "base_model_name_or_path 'Qwen/Qwen3-0.6B': not a local directory; pass the model training started "
            "from as a model directory to --reference",
        ),
        (
            ["{dense}", "--dataset", "{pairs}", "--reference", "{other_vocab}"],
            "--reference {other_vocab}: vocab_size 4160 (config.json), the model's is 4096",
        ),
    ],
    ids=[
        "missing-dir",
        "no-config",
        "missing-dataset",
        "seq-len-beyond-positions",
        "no-tokenizer",
        "tokenizer-not-a-tokenizer",
        "no-held-out-records",
        "unknown-backend",
        "zero-seq-len",
        "bad-record",
        "adapter-base-not-local",
        "base-without-adapter",
        "pairs-without-reference",
        "reference-without-pairs",
        "missing-reference",
        "pairs-at-random-init",
        "zero-beta",
        "reference-adapter-base-not-local",
        "reference-of-another-vocabulary",
    ],  # fmt: skip
)
def test_bad_input_is_one_line_and_writes_nothing(
    capsys, tmp_path, monkeypatch, dense, other_vocab, argv, fragment
):
    monkeypatch.chdir(tmp_path)
    bad_record = tmp_path / "bad.jsonl"
    bad_record.write_text('{"text": "fine"}\n{"text": 3}\n')
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "Is it?", "chosen": " Yes.", "rejected": " No."}\n')
    (tmp_path / "empty").mkdir()
    names = {
        "missing": tmp_path / "missing",
        "empty": tmp_path / "empty",
        "dense": dense,
        "bad_record": bad_record,
        "pairs": pairs,
        "other_vocab": other_vocab,
        "hub_adapter": _hub_adapter(tmp_path / "adapter", dense),
        "untokenized": _without_tokenizer(tmp_path / "untokenized", dense),
    }
    before = _listing(tmp_path, dense)
    assert main([a.format(**names) for a in argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("eval: "), captured.err
    assert fragment.format(**names) in lines[0]
    assert _listing(tmp_path, dense) == before
