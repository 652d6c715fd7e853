"""A Hugging Face model directory as made by ``hf download`` or ``save_pretrained``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub.constants import PYTORCH_WEIGHTS_NAME, SAFETENSORS_INDEX_FILE, SAFETENSORS_SINGLE_FILE

from qwen3_titan_common.arch.architecture import Qwen3Architecture, read_architecture
from qwen3_titan_common.errors import CheckpointError
from qwen3_titan_common.hf.remote import remote_model_message
from qwen3_titan_common.hf.safetensors_header import TRAINABLE, TensorEntry, read_header, torch_name

# huggingface_hub names the weight files; these it does not.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)
GENERATION_CONFIG = "generation_config.json"
_PICKLE_WEIGHTS = (PYTORCH_WEIGHTS_NAME, "pytorch_model.bin.index.json", "model.pt", "consolidated.00.pth")


@dataclass(frozen=True)
class HFModelDir:
    path: Path
    architecture: Qwen3Architecture
    tensors: dict[str, TensorEntry] = field(repr=False)
    tokenizer_files: tuple[str, ...]
    has_generation_config: bool
    adapter: object | None = field(default=None, repr=False)
    """A peft LoRA adapter (``hf.adapter.AdapterDir``) merged into these weights as they are read, or None."""

    @property
    def has_tokenizer(self) -> bool:
        return "tokenizer.json" in self.tokenizer_files or "vocab.json" in self.tokenizer_files

    @property
    def weight_files(self) -> list[Path]:
        return sorted({entry.file for entry in self.tensors.values()})

    @property
    def weight_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.weight_files)

    @property
    def dtype_name(self) -> str:
        """The most common tensor dtype on disk, as torch names it."""
        counts: dict[str, int] = {}
        for entry in self.tensors.values():
            counts[entry.dtype] = counts.get(entry.dtype, 0) + 1
        return torch_name(max(counts, key=counts.get) if counts else "F32")


def resolve_local_dir(path: str | Path, flag: str = "--hf.model_dir") -> Path:
    text = str(path)
    remote = remote_model_message(text, flag)
    if remote is not None:
        raise CheckpointError(remote)
    resolved = Path(text).expanduser().resolve()
    if resolved.is_file():
        parent = " (the directory holding it is " + str(resolved.parent) + ")" if resolved.suffix else ""
        raise CheckpointError(
            f"{flag} {text}: is a file, not a directory; pass the model directory (config.json and "
            f"safetensors files){parent}"
        )
    if not resolved.is_dir():
        raise CheckpointError(f"{flag} {text}: no such directory ({resolved})")
    return resolved


def check_trainable_dtypes(tensors: dict[str, TensorEntry]) -> None:
    """Refuse weights that are not floating point, naming the first such tensor and its dtype on disk.

    Loaded into a float model they would be converted silently (an int8 checkpoint trains with zero
    gradients and is logged as float32); a quantised checkpoint needs dequantising first.
    """
    odd = sorted((key, entry) for key, entry in tensors.items() if entry.dtype not in TRAINABLE)
    if not odd:
        return
    key, entry = odd[0]
    more = f" (and {len(odd) - 1} more such tensors)" if len(odd) > 1 else ""
    raise CheckpointError(
        f"{entry.file}: tensor '{key}' is {torch_name(entry.dtype)} on disk{more}; expected floating-point weights "
        "(float32, bfloat16, float16): a quantised checkpoint needs dequantising to one of them first"
    )


def _weight_map(path: Path) -> dict[str, Path]:
    index_path = path / SAFETENSORS_INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(
                f"{index_path}: not a safetensors index ({err!r}; expected a 'weight_map')"
            ) from None
        if isinstance(weight_map, dict) and not weight_map:
            raise CheckpointError(
                f"{index_path}: its 'weight_map' is empty (it names no tensor and no shard)"
            )
        if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
            raise CheckpointError(
                f"{index_path}: not a safetensors index (expected 'weight_map' to map tensor names to file names)"
            )
        files = {}
        for key, name in weight_map.items():
            shard = path / name
            if not shard.is_file():
                raise CheckpointError(f"{index_path}: names shard '{name}' for '{key}', which is missing")
            files[key] = shard
        return files
    single = path / SAFETENSORS_SINGLE_FILE
    if single.is_file():
        return {}
    pickled = [name for name in _PICKLE_WEIGHTS if (path / name).exists()]
    if pickled:
        raise CheckpointError(
            f"{path / pickled[0]}: PyTorch pickle weights are never loaded (unpickling runs code); convert "
            "them once to safetensors, e.g. `AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR)` "
            "in a trusted environment, and pass NEW_DIR"
        )
    raise CheckpointError(
        f"{path}: no {SAFETENSORS_SINGLE_FILE} or {SAFETENSORS_INDEX_FILE} (a Hugging Face model directory needs one)"
    )


def _read_tensors(path: Path) -> dict[str, TensorEntry]:
    weight_map = _weight_map(path)
    if not weight_map:
        return read_header(path / SAFETENSORS_SINGLE_FILE)
    tensors: dict[str, TensorEntry] = {}
    headers = {shard: read_header(shard) for shard in sorted(set(weight_map.values()))}
    for key, shard in weight_map.items():
        if key not in headers[shard]:
            raise CheckpointError(
                f"{path / SAFETENSORS_INDEX_FILE}: says '{key}' is in {shard.name}, which does not hold it"
            )
        others = [other.name for other, entries in headers.items() if other != shard and key in entries]
        if others:
            # transformers reads the index's copy, torchtitan's sharded reader may take the other: refused, so
            # that what trains is what transformers would load.
            raise CheckpointError(
                f"{path / others[0]}: holds tensor '{key}' too, which {path / SAFETENSORS_INDEX_FILE} places in "
                f"{shard.name}; a checkpoint stores each tensor once (remove the stray copy)"
            )
        tensors[key] = headers[shard][key]
    for entries in headers.values():
        for key in entries.keys() - weight_map.keys():
            tensors[key] = entries[key]  # present but unindexed: reported as unexpected if not a model key
    return tensors


def _check_tied_head(
    config_path: Path, architecture: Qwen3Architecture, tensors: dict[str, TensorEntry]
) -> None:
    """A tied model whose file also holds an ``lm_head.weight`` of other values: transformers v5 loads that
    head as it is (an untied model, in effect), our backends would tie it to the embedding. Refused."""
    head, embedding = tensors.get("lm_head.weight"), tensors.get("model.embed_tokens.weight")
    if not (architecture.tie_word_embeddings and head is not None and embedding is not None):
        return
    if tuple(head.shape) != tuple(embedding.shape):
        return  # a head of the wrong shape: the key and shape checks name it with the shape expected
    import torch
    from safetensors import safe_open

    with safe_open(str(head.file), framework="pt") as f:
        head_values = f.get_tensor("lm_head.weight")
    with safe_open(str(embedding.file), framework="pt") as f:
        embedding_values = f.get_tensor("model.embed_tokens.weight")
    if not torch.equal(head_values, embedding_values):
        raise CheckpointError(
            f"{head.file}: tensor 'lm_head.weight' differs from 'model.embed_tokens.weight', but {config_path} "
            "says tie_word_embeddings true (one matrix): set it false to train both, or drop lm_head.weight"
        )


def open_model_dir(path: str | Path, flag: str = "--hf.model_dir") -> HFModelDir:
    """Check a model directory's files and read its config and tensor headers (no weights but a tied model's
    stored lm_head, compared with its embedding)."""
    resolved = resolve_local_dir(path, flag)
    architecture = read_architecture(resolved)
    tensors = _read_tensors(resolved)
    check_trainable_dtypes(tensors)
    _check_tied_head(resolved / "config.json", architecture, tensors)
    return HFModelDir(
        path=resolved,
        architecture=architecture,
        tensors=tensors,
        tokenizer_files=tuple(name for name in TOKENIZER_FILES if (resolved / name).is_file()),
        has_generation_config=(resolved / GENERATION_CONFIG).is_file(),
    )
