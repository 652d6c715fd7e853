"""``verify-checkpoint DIR``: does this Hugging Face directory load and compute the same everywhere?

1. Checks the directory's files and its tensor names and shapes against the
   architecture its config.json describes (missing / unexpected / mismatched keys).
2. Loads it with ``transformers.AutoModelForCausalLM`` and with torchtitan's native
   Qwen3, runs the same tokens through both, and prints the max absolute logits
   difference and the loss on a fixed text.
3. ``--against OTHER`` also compares two checkpoints: tensor by tensor and by logits.

A peft LoRA adapter directory is verified on its base (``base_model_name_or_path``, or ``--base``): its
tensors against the base's architecture (one line naming the first that does not fit), then peft's model
(``PeftModel.from_pretrained`` on transformers' base) against torchtitan's Qwen3 holding the merged weights.

Exits 1 past ``--tolerance`` or on non-finite logits; 2, with one line naming the file or tensor, on a
directory that does not load: files, keys or shapes that do not fit its config.json, weights holding
NaN/Inf, or anything transformers or torchtitan refuse when loading it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import warnings
from dataclasses import dataclass

import torch

from qwen3_titan_common.arch.architecture import ArchitectureError
from qwen3_titan_common.errors import CheckpointError
from qwen3_titan_common.hf.expected_keys import expected_hf_shapes, key_problems
from qwen3_titan_common.hf.model_dir import HFModelDir, open_model_dir

FIXED_TEXT = (
    "Return a new sorted list from the items in iterable. A custom key function can be supplied to "
    "customize the sort order, and the reverse flag can be set to request the result in descending order."
)


@dataclass(frozen=True)
class Report:
    key_problems: list[str]
    logits_max_abs_diff: float
    loss_transformers: float
    loss_titan: float


def _tokens(model_dir: HFModelDir, text: str) -> torch.Tensor:
    from transformers import AutoTokenizer

    from qwen3_titan_common.assets import default_tokenizer_dir

    source = model_dir.path if model_dir.has_tokenizer else default_tokenizer_dir()
    ids = AutoTokenizer.from_pretrained(str(source)).encode(text)
    ids = [i % model_dir.architecture.vocab_size for i in ids]
    return torch.tensor([ids])


def _loss(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    return torch.nn.functional.cross_entropy(logits[0, :-1].float(), tokens[0, 1:]).item()


def _transformers_logits(model_dir: HFModelDir, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers' logits; for an adapter, peft's model on transformers' base, as peft users load it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir.path), dtype=dtype, trust_remote_code=False)
    if model_dir.adapter is not None:
        from peft import PeftModel

        with warnings.catch_warnings():
            # peft asks transformers a deprecated question while loading: noise in a report.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            model = PeftModel.from_pretrained(model, str(model_dir.adapter.path))
    model = model.eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def verify(model_dir: HFModelDir, text: str = FIXED_TEXT, dtype: torch.dtype = torch.float32) -> Report:
    from qwen3_titan_common.hf.titan_load import build_titan_qwen3

    arch = model_dir.architecture
    found = {k: e.shape for k, e in model_dir.tensors.items()}
    problems = key_problems(expected_hf_shapes(arch), found, tied=arch.tie_word_embeddings)
    tokens = _tokens(model_dir, text)
    hf_logits = _transformers_logits(model_dir, tokens, dtype)
    titan = build_titan_qwen3(model_dir, dtype=dtype, seq_len=max(tokens.shape[1], 16))
    with torch.no_grad():
        titan_logits = titan(tokens).float()
    return Report(
        key_problems=problems,
        logits_max_abs_diff=(hf_logits - titan_logits).abs().max().item(),
        loss_transformers=_loss(hf_logits, tokens),
        loss_titan=_loss(titan_logits, tokens),
    )


def compare_checkpoints(
    a: HFModelDir, b: HFModelDir, text: str, dtype: torch.dtype
) -> tuple[float, float, list[str]]:
    """(max tensor diff, max logits diff, key differences) between two directories."""
    from qwen3_titan_common.hf.titan_load import read_hf_state_dict

    sa, sb = read_hf_state_dict(a, dtype), read_hf_state_dict(b, dtype)
    differences = [f"only in {a.path}: {k}" for k in sorted(sa.keys() - sb.keys())]
    differences += [f"only in {b.path}: {k}" for k in sorted(sb.keys() - sa.keys())]
    tensor_diff = 0.0
    for key in sa.keys() & sb.keys():
        if sa[key].shape != sb[key].shape:
            differences.append(f"{key}: shape {list(sa[key].shape)} vs {list(sb[key].shape)}")
            continue
        tensor_diff = max(tensor_diff, (sa[key] - sb[key]).abs().max().item())
    tokens = _tokens(a, text)
    logits_diff = (
        (_transformers_logits(a, tokens, dtype) - _transformers_logits(b, tokens, dtype)).abs().max().item()
    )
    return tensor_diff, logits_diff, differences


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="verify-checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "model_dir",
        help="Hugging Face model directory (config.json + safetensors), or a peft adapter directory",
    )
    p.add_argument(
        "--base", metavar="DIR", help="an adapter's base model (default: its base_model_name_or_path)"
    )
    p.add_argument("--against", metavar="OTHER_DIR", help="also compare with this checkpoint")
    p.add_argument("--tolerance", type=float, default=1e-4, help="max abs logits difference (default 1e-4)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--text", default=FIXED_TEXT, help="text for the loss (default: a fixed sentence)")
    return p


def check_loadable(model_dir: HFModelDir) -> None:
    """What must hold before a directory is worth loading: its keys and shapes fit its config.json, and
    every weight is finite (one pass over each shard, one shard in memory at a time)."""
    from qwen3_titan_common.components.weight_check import is_finite
    from qwen3_titan_common.hf.titan_load import iter_hf_shard_files

    arch = model_dir.architecture
    found = {k: e.shape for k, e in model_dir.tensors.items()}
    problems = key_problems(expected_hf_shapes(arch), found, tied=arch.tie_word_embeddings)
    if problems:
        raise CheckpointError(
            f"{model_dir.path}: checkpoint does not fit its config.json: " + "; ".join(problems)
        )
    for path, shard in iter_hf_shard_files(dataclasses.replace(model_dir, adapter=None)):
        for key, tensor in shard.items():
            if not is_finite(tensor):
                raise CheckpointError(f"{path}: tensor '{key}' holds NaN or Inf values")
    if model_dir.adapter is not None:
        for key, tensor in model_dir.adapter.read().items():
            if not is_finite(tensor):
                raise CheckpointError(f"{model_dir.adapter.path}: tensor '{key}' holds NaN or Inf values")


def _open(path: str, flag: str, base: str | None = None) -> HFModelDir:
    from qwen3_titan_common.hf.adapter import is_adapter_dir, open_adapted_model

    if is_adapter_dir(path):
        return open_adapted_model(path, base, flag=flag)
    if base is not None:
        raise CheckpointError(f"--base {base}: {path} is a model directory, not a peft adapter; drop --base")
    return open_model_dir(path, flag=flag)


def _one_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    try:
        model_dir = _open(args.model_dir, "verify-checkpoint", args.base)
        other = _open(args.against, "--against") if args.against else None
        for checked in (model_dir, other):
            if checked is not None:
                check_loadable(checked)
    except (CheckpointError, ArchitectureError) as err:
        print(f"verify-checkpoint: {err}", file=sys.stderr)
        return 2
    try:
        return _report(args, model_dir, other, dtype)
    except Exception as err:  # transformers or torchtitan refused the directory after all our checks
        print(
            f"verify-checkpoint: {model_dir.path}: does not load ({type(err).__name__}: {_one_line(err)})",
            file=sys.stderr,
        )
        return 2


def _report(
    args: argparse.Namespace, model_dir: HFModelDir, other: HFModelDir | None, dtype: torch.dtype
) -> int:
    arch = model_dir.architecture
    kind = "MoE" if arch.is_moe else "dense"
    adapter = model_dir.adapter
    if adapter is not None:
        print(
            f"{adapter.path}: peft LoRA adapter, rank {adapter.params.rank}, alpha {adapter.params.alpha:g}, "
            f"{len(adapter.shapes)} tensors on {', '.join(adapter.target_modules)}; its base:"
        )
    print(
        f"{model_dir.path}: Qwen3 {kind}, {arch.num_hidden_layers} layers, hidden {arch.hidden_size}, "
        f"vocab {arch.vocab_size}, tied {arch.tie_word_embeddings}, rope_theta {arch.rope_theta:g}, "
        f"{len(model_dir.tensors)} tensors ({model_dir.dtype_name})"
    )
    report = verify(model_dir, args.text, dtype)
    failed = False
    if report.key_problems:
        failed = True
        for problem in report.key_problems:
            print(f"keys: {problem}")
    else:
        print("keys: complete (no missing, unexpected or mismatched tensors)")
    reference = "peft" if adapter is not None else "transformers"
    print(
        f"logits max |{reference} - torchtitan|: {report.logits_max_abs_diff:.3e} (tolerance {args.tolerance:g})"
    )
    print(
        f"loss on the fixed text: transformers {report.loss_transformers:.6f}, torchtitan {report.loss_titan:.6f}"
    )
    failed |= not report.logits_max_abs_diff <= args.tolerance  # NaN compares false: it fails too
    if not (math.isfinite(report.loss_transformers) and math.isfinite(report.loss_titan)):
        print("logits: not finite (NaN or Inf) on the fixed text")
        failed = True
    if other is not None:
        tensor_diff, logits_diff, differences = compare_checkpoints(model_dir, other, args.text, dtype)
        for line in differences:
            print(f"against: {line}")
        print(f"against {other.path}: max tensor diff {tensor_diff:.3e}, logits max diff {logits_diff:.3e}")
        failed |= bool(differences) or not logits_diff <= args.tolerance
    print("FAILED" if failed else "OK")
    return 1 if failed else 0


def console_main() -> None:
    sys.exit(main())
