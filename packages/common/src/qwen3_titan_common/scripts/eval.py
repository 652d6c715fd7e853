"""``eval DIR``: loss, perplexity and token count of a Hugging Face checkpoint on held-out data.

    eval outputs/native-debug/hf/step-30                     # the embedded corpus's held-out part
    eval DIR --random-init                                   # and the same architecture at random init
    eval DIR --dataset data/valid.jsonl --seq-len 2048 --json
    eval DIR --backend hf-v5-backend                         # through an installed backend's model
    eval ADAPTER_DIR [--base DIR]                            # a peft LoRA adapter on its base model
    eval DIR --dataset pairs.jsonl --reference START_DIR     # DPO loss, accuracy, margin on held-out pairs

The rows are the ones validation reads while training (``data.validation``): one pass, packed as for a
single rank, padded to full batches whose padding carries no labels, so the loss does not depend on the
batch size. With the run's ``--training.seq_len``, its global batch as ``--batch-size`` and its
``--validator.steps`` as ``--max-batches``, ``eval`` of an export repeats the run's validation at that step.
The model is torchtitan's native Qwen3 (MoE included) by default, or ``--backend``'s own, on the device this
machine has (Neuron, CUDA, else CPU); nothing is written. A peft adapter directory is scored as the model
it makes, its base (``base_model_name_or_path``, or ``--base``) with the adapter merged as peft merges it
(``hf.adapter.open_adapted_model``): the scores of ``--lora.merge``'s export. Preference pairs are scored
against ``--reference``, the model preference training started from (``scripts.eval_pairs``), with the
run's ``--dpo.*`` settings. Bad input: one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import warnings
from dataclasses import asdict, dataclass

import torch

from qwen3_titan_common.errors import UserInputError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class EvalError(UserInputError):
    pass


@dataclass(frozen=True)
class EvalResult:
    model: str
    loss: float
    perplexity: float
    tokens: int  # tokens whose prediction was scored
    rows: int  # rows of seq_len run through the model, padding rows included
    tokens_per_second: float  # input tokens (rows x seq_len) through the model per second


def _perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


def evaluate(model: torch.nn.Module, loader, device: torch.device, name: str, max_batches: int | None = None):
    """Loss over the scored tokens of every batch of ``loader`` (the validator's loss: a sum, then one division)."""
    from torchtitan.components.loss import IGNORE_INDEX, CrossEntropyLoss

    loss_fn = CrossEntropyLoss.Config().build()
    model = model.to(device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    tokens = rows = seq_len = 0
    start = time.perf_counter()
    with torch.no_grad():
        for batch, (input_dict, labels) in enumerate(loader):
            if max_batches is not None and batch >= max_batches:
                break
            inputs = {k: v.to(device) for k, v in input_dict.items()}
            labels = labels.to(device)
            logits = model(inputs.pop("input"), **inputs)
            batch_loss, _ = loss_fn(logits, labels)
            loss_sum += batch_loss.double()
            tokens += int((labels != IGNORE_INDEX).sum())
            rows += labels.shape[0]
            seq_len = labels.shape[1]
    total = float(loss_sum)  # synchronises the device before the clock stops
    seconds = time.perf_counter() - start
    if tokens == 0:
        raise EvalError(f"{name}: the evaluation data holds no token to score")
    loss = total / tokens
    return EvalResult(name, loss, _perplexity(loss), tokens, rows, rows * seq_len / seconds)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eval", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument(
        "model_dir",
        help="Hugging Face model directory (config.json + safetensors), or a peft adapter directory",
    )
    p.add_argument(
        "--base",
        default=None,
        help="an adapter's base model directory (default: its base_model_name_or_path)",
    )
    p.add_argument(
        "--dataset",
        default="default",
        help="'default' (the embedded corpus), a .jsonl/.json/.parquet file, a directory, a save_to_disk directory",
    )
    p.add_argument(
        "--split",
        default="auto",
        help="split of a directory or DatasetDict (auto: validation, test, else train)",
    )
    p.add_argument(
        "--records",
        choices=("auto", "held_out", "all"),
        default="auto",
        help="the dataset's held-out share (what a run training on it validates on) or all of it "
        "(auto: held_out for the embedded corpus, all otherwise)",
    )
    p.add_argument("--held-out", type=float, default=None, help="the held-out share (default 0.05)")
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="tokenizer directory, for a model directory without tokenizer files ('default': the embedded one)",
    )
    p.add_argument("--on-bad-record", choices=("stop", "skip"), default="stop")
    p.add_argument("--allow-network", action="store_true", help="let a Hub dataset id be downloaded")
    p.add_argument("--format", choices=("auto", "text", "chat"), default="auto")
    p.add_argument("--text-field", default="text")
    p.add_argument("--messages-field", default="messages")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per row (default 256, the debug runs')")
    p.add_argument("--batch-size", type=int, default=8, help="rows per forward pass (default 8)")
    p.add_argument(
        "--max-batches", type=int, default=None, help="stop after this many batches (default: all)"
    )
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    p.add_argument(
        "--backend", default=None, help="an installed backend's model (default: torchtitan's Qwen3)"
    )
    p.add_argument(
        "--random-init", action="store_true", help="add the same architecture at random initialisation"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random initialisation (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    pairs = p.add_argument_group("preference pairs (chosen/rejected data)")
    pairs.add_argument(
        "--reference",
        default=None,
        metavar="DIR",
        help="the model preference training started from (a model or adapter directory): the DPO reference",
    )
    from qwen3_titan_common.components.preference import PreferenceOptions

    defaults = PreferenceOptions()
    pairs.add_argument("--dpo.beta", dest="beta", type=float, default=defaults.beta)
    pairs.add_argument(
        "--dpo.loss_type", dest="loss_type", choices=("sigmoid", "ipo"), default=defaults.loss_type
    )
    pairs.add_argument(
        "--dpo.label_smoothing", dest="label_smoothing", type=float, default=defaults.label_smoothing
    )
    pairs.add_argument("--dpo.sft_weight", dest="sft_weight", type=float, default=defaults.sft_weight)
    return p


def _positive(value: int | None, flag: str) -> None:
    if value is not None and value < 1:
        raise EvalError(f"{flag} {value}: expected a positive integer")


def eval_model_builder(name: str | None):
    """The model builder: torchtitan's native Qwen3, or the one ``--backend`` names."""
    from qwen3_titan_common.hf.eval_models import eval_model_of

    if name is None:
        return eval_model_of("qwen3_titan_common.hf.eval_models:native_qwen3"), "torchtitan Qwen3"
    from qwen3_titan_common.launcher.dispatch import installed_backends

    backends = {n: b for n, b in installed_backends().items() if b.eval_model}
    if name not in backends:
        raise EvalError(
            f"--backend {name}: not an installed backend (installed: {', '.join(backends) or 'none'})"
        )
    return eval_model_of(backends[name].eval_model), name


def _open(path: str, base: str | None = None, flag: str = "model directory", no_base: str | None = None):
    from qwen3_titan_common.hf.adapter import is_adapter_dir, open_adapted_model
    from qwen3_titan_common.hf.expected_keys import check_keys, expected_hf_shapes
    from qwen3_titan_common.hf.model_dir import open_model_dir

    if is_adapter_dir(path):
        model_dir = open_adapted_model(path, base, flag=flag, no_base=no_base)
    elif base is not None:
        raise EvalError(f"--base {base}: {path} is a model directory, not a peft adapter; drop --base")
    else:
        model_dir = open_model_dir(path, flag=flag)
    arch = model_dir.architecture
    found = {key: entry.shape for key, entry in model_dir.tensors.items()}
    check_keys(str(model_dir.path), expected_hf_shapes(arch), found, tied=arch.tie_word_embeddings)
    return model_dir


def _tokenizer(model_dir, asked: str | None):
    from pathlib import Path

    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from qwen3_titan_common.assets import default_tokenizer_dir

    if asked is not None:
        source = default_tokenizer_dir() if asked == "default" else Path(asked).expanduser()
        if not (source / "tokenizer.json").is_file():
            raise EvalError(f"--tokenizer {asked}: no tokenizer.json there (expected a tokenizer directory)")
    elif model_dir.has_tokenizer:
        source = model_dir.path
    else:
        # Another tokenizer's ids score another text: the loss would mean nothing, and say nothing of it.
        raise EvalError(
            f"{model_dir.path}: no tokenizer files (tokenizer.json) beside the model; pass --tokenizer DIR "
            "(the tokenizer the model was trained with; 'default' for the embedded one)"
        )
    tokenizer = HuggingFaceTokenizer(tokenizer_path=str(source))
    vocab = model_dir.architecture.vocab_size
    if tokenizer.get_vocab_size() > vocab:
        raise EvalError(
            f"{source}: the tokenizer has {tokenizer.get_vocab_size()} tokens, more than the model's vocab_size "
            f"{vocab} (config.json)"
        )
    return tokenizer, source


def _data_config(args):
    from qwen3_titan_common.data.holdout import DEFAULT_HELD_OUT
    from qwen3_titan_common.data.sources import DEFAULT_DATASET, split_names
    from qwen3_titan_common.data.validation import VALIDATION_SPLITS, ValidationDataLoader

    split = args.split
    if split == "auto":
        names = split_names(args.dataset)
        split = next((s for s in VALIDATION_SPLITS if s in names), "train")
    records = args.records
    if records == "auto":
        records = "held_out" if args.dataset == DEFAULT_DATASET else "all"
    held_out = args.held_out
    if held_out is None and records == "held_out":
        held_out = DEFAULT_HELD_OUT  # what a run validating on this data holds out unless told otherwise
    return ValidationDataLoader.Config(
        dataset=args.dataset,
        split=split,
        records=records,
        held_out=held_out,
        format=args.format,
        text_field=args.text_field,
        messages_field=args.messages_field,
        on_bad_record=args.on_bad_record,
        allow_network=args.allow_network,
    )


# The data loader's errors name training's flags; eval's and preview-data's own are these.
_COMMAND_FLAGS = {
    "split": "--split",
    "format": "--format",
    "text_field": "--text-field",
    "messages_field": "--messages-field",
    "tools_field": "--tools-field",
    "earlier_reasoning": "--earlier-reasoning",
    "held_out": "--held-out",
    "on_bad_record": "--on-bad-record",
    "allow_network": "--allow-network",
}
_TRAIN_FLAG = re.compile(r"--(?:validator\.)?dataloader\.(\w+)|--training\.seq_len")
_TRAIN_ONLY = ", or --validator.no-enable"  # a way out that only `train` has


def in_command_flags(message: str, dataset: str = "--dataset") -> str:
    """``message`` with each training flag it names replaced by the command's flag for the same setting;
    ``dataset``: how the command takes the dataset (a flag, or preview-data's positional DATASET)."""

    def flag(match: re.Match) -> str:
        if match.group(0) == "--training.seq_len":
            return "--seq-len"
        if match.group(1) == "dataset":
            return dataset
        return _COMMAND_FLAGS.get(match.group(1), match.group(0))

    return _TRAIN_FLAG.sub(flag, message.replace(_TRAIN_ONLY, ""))


def _describe(config) -> str:
    name = "the embedded corpus" if config.dataset == "default" else config.dataset
    part = "the held-out part of " if config.records == "held_out" else ""
    split = "" if config.dataset == "default" else f" (split '{config.split}')"
    return f"{part}{name}{split}"


def run(args: argparse.Namespace) -> dict:
    from qwen3_titan_common.runtime.device import detect_device

    for value, flag in ((args.seq_len, "--seq-len"), (args.batch_size, "--batch-size"), (args.max_batches, "--max-batches")):  # fmt: skip
        _positive(value, flag)
    model_dir = _open(args.model_dir, args.base)
    positions = model_dir.architecture.max_position_embeddings
    if args.seq_len > positions:
        raise EvalError(
            f"--seq-len {args.seq_len}: longer than the model's max_position_embeddings {positions} "
            f"({model_dir.path}/config.json)"
        )
    shown = (
        str(model_dir.path) if model_dir.adapter is None else f"{model_dir.adapter.path} on {model_dir.path}"
    )
    build, model_name = eval_model_builder(args.backend)
    tokenizer, tokenizer_source = _tokenizer(model_dir, args.tokenizer)
    data = _data_config(args)
    device_info = detect_device()
    device = torch.device(device_info.kind)
    dtype = DTYPES[args.dtype]
    arch = model_dir.architecture

    def loader(config=data):
        return config.build(
            dp_world_size=1,
            dp_rank=0,
            tokenizer=tokenizer,
            seq_len=args.seq_len,
            local_batch_size=args.batch_size,
        )

    results = []
    extra = {}
    first = loader()  # each pass over it starts again from its first record
    if first.dataset.stream.preference is not None:
        results, extra = _score_pairs(args, build, model_dir, data, loader, shown, device)
    else:
        if args.reference is not None:
            raise EvalError(
                f"--reference {args.reference}: a reference scores preference pairs (chosen/rejected); "
                f"{_describe(data)} holds {data.format if data.format != 'auto' else 'text or chat'} records"
            )
        model = build(arch, model_dir, dtype=dtype, seq_len=args.seq_len, seed=args.seed)
        results.append(evaluate(model, first, device, shown, args.max_batches))
        del model
        if args.random_init:
            model = build(arch, None, dtype=dtype, seq_len=args.seq_len, seed=args.seed)
            results.append(
                evaluate(model, loader(), device, f"random init (seed {args.seed})", args.max_batches)
            )
    return {
        "model_dir": shown,
        "model": model_name,
        "device": device_info.kind,
        "dtype": args.dtype,
        "data": _describe(data),
        "tokenizer": str(tokenizer_source),
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "ln_vocab": math.log(arch.vocab_size),
        "results": [asdict(r) for r in results],
        **extra,
    }


def _score_pairs(args, build, model_dir, data, loader, shown: str, device) -> tuple[list, dict]:
    """The model's and then the reference's pass over the pairs, one model in memory at a time; every
    refusal before either is built."""
    import dataclasses

    from qwen3_titan_common.components.preference import PreferenceOptions
    from qwen3_titan_common.models.attention import uses_document_blocks
    from qwen3_titan_common.scripts.eval_pairs import pair_sums, score_pairs

    if args.reference is None:
        raise EvalError(
            f"{_describe(data)} holds preference pairs: their DPO loss compares the model with the one training "
            "started from; pass that as --reference DIR"
        )
    if args.random_init:
        raise EvalError("--random-init: scores text and chat data; drop it with preference pairs")
    options = PreferenceOptions(
        beta=args.beta,
        loss_type=args.loss_type,
        label_smoothing=args.label_smoothing,
        sft_weight=args.sft_weight,
    )
    # --base is the evaluated adapter's; a reference adapter brings its own base.
    reference_dir = _open(
        args.reference,
        flag="--reference",
        no_base="pass the model training started from as a model directory to --reference",
    )
    ours, theirs = model_dir.architecture, reference_dir.architecture
    if theirs.vocab_size != ours.vocab_size:
        raise EvalError(
            f"--reference {args.reference}: vocab_size {theirs.vocab_size} (config.json), the model's is "
            f"{ours.vocab_size}; the reference is the model training started from, with the same tokenizer"
        )
    if args.seq_len > theirs.max_position_embeddings:
        raise EvalError(
            f"--seq-len {args.seq_len}: longer than the reference's max_position_embeddings "
            f"{theirs.max_position_embeddings} ({reference_dir.path}/config.json)"
        )
    dtype = DTYPES[args.dtype]
    model = build(ours, model_dir, dtype=dtype, seq_len=args.seq_len, seed=args.seed)
    # The prompt computed once where the model's attention reads continuations, as training packs pairs.
    data = dataclasses.replace(data, share_prompt=uses_document_blocks(getattr(model, "config", None)))
    pairs = loader(data)
    policy = pair_sums(model, pairs, device, args.max_batches)
    del model
    reference_model = build(theirs, reference_dir, dtype=dtype, seq_len=args.seq_len, seed=args.seed)
    reference = pair_sums(reference_model, pairs, device, args.max_batches)
    result = score_pairs(shown, policy, reference, options, args.seq_len)
    return [result], {"reference": str(reference_dir.path), "dpo": options.describe()}


def _table(report: dict) -> str:
    lines = [
        f"{report['model_dir']}: {report['model']} on {report['device']} ({report['dtype']}), "
        f"{_describe_rows(report)} of {report['data']}",
    ]
    if "reference" in report:
        from qwen3_titan_common.scripts.eval_pairs import pairs_table

        return "\n".join(lines + pairs_table(report))
    lines += [
        "",
        "| model | loss | perplexity | tokens | tokens/s |",
        "|---|---|---|---|---|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['model']} | {r['loss']:.5f} | {r['perplexity']:,.2f} | {r['tokens']:,} | {r['tokens_per_second']:,.0f} |"
        )
    lines += ["", f"ln(vocab_size) = {report['ln_vocab']:.4f}: the loss of a uniform guess"]
    return "\n".join(lines)


def _describe_rows(report: dict) -> str:
    rows = report["results"][0]["rows"]
    return f"{rows} rows of {report['seq_len']} tokens"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # torchdata's dataloader calls a deprecated torch API on every construction: noise in a report.
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
    try:
        report = run(args)
    except UserInputError as err:
        print(f"eval: {in_command_flags(str(err))}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else _table(report))
    return 0


def console_main() -> None:
    sys.exit(main())


if __name__ == "__main__":
    console_main()
