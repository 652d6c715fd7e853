"""What an export holds beside its weights, and the modes its files get.

Every export carries a ``generation_config.json`` (the source's, else one that stops at the chat
template's end of turn and at EOS) and a tokenizer whose ``model_max_length`` is the model's
``max_position_embeddings``; every file and directory of an export, and of a LoRA adapter folder,
gets the modes the user's umask gives new files. The in-process writers here are the ones training
calls (``components.checkpoint`` through ``export_hf_dir``, ``components.lora_checkpoint`` through
``write_adapter_dir``).
"""

import json
import os
import stat
from contextlib import contextmanager

import pytest
import torch
from qwen3_titan_common.assets import default_model_dir, default_tokenizer_dir
from qwen3_titan_common.hf.adapter import AdapterSpec, write_adapter_dir
from qwen3_titan_common.hf.export import EXPORT_MARKER, ExportSpec, export_hf_dir
from qwen3_titan_common.models.lora import LoRAParams
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint
from qwen3_titan_testing.qwen3_tokenizer import QWEN3_VOCAB_SIZE, qwen3_tokenizer_dir
from transformers import AutoTokenizer, GenerationConfig


def _default_config() -> dict:
    return json.loads((default_model_dir() / "config.json").read_text())


def _export(out_dir, config, assets_dir, tensors=None, **kw):
    tensors = tensors or {"w": torch.ones(2)}
    spec = ExportSpec(
        out_dir=out_dir,
        config=config,
        dtype=torch.float32,
        assets_dir=assets_dir,
        shapes={key: tuple(t.shape) for key, t in tensors.items()},
        **kw,
    )
    return export_hf_dir(spec, tensors.items())


def test_the_embedded_tokenizer_is_as_long_as_the_embedded_model():
    positions = _default_config()["max_position_embeddings"]
    settings = json.loads((default_tokenizer_dir() / "tokenizer_config.json").read_text())
    assert settings["model_max_length"] == positions == 2048
    assert AutoTokenizer.from_pretrained(str(default_tokenizer_dir())).model_max_length == positions


def test_an_export_without_a_source_generation_config_stops_at_the_end_of_turn_and_at_eos(tmp_path):
    out = _export(tmp_path / "export", _default_config(), default_tokenizer_dir())
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    # The chat template closes each turn with <|im_end|>; the end of turn comes first, as in Qwen3's own.
    assert tokenizer.apply_chat_template([{"role": "assistant", "content": "x"}], tokenize=False).endswith(
        "x<|im_end|>\n"
    )
    written = json.loads((out / "generation_config.json").read_text())
    assert written["eos_token_id"] == [im_end, endoftext] == [2, 0]
    assert written["pad_token_id"] == tokenizer.pad_token_id == endoftext
    loaded = GenerationConfig.from_pretrained(str(out))
    assert loaded.eos_token_id == [im_end, endoftext] and loaded.pad_token_id == endoftext
    assert "generation_config.json" in json.loads((out / EXPORT_MARKER).read_text())["files"]
    assert tokenizer.model_max_length == 2048


def test_with_the_qwen3_tokenizer_the_written_ids_are_those_of_qwen3s_own_generation_config(tmp_path):
    tokenizer_dir = qwen3_tokenizer_dir(tmp_path / "tokenizer")
    config = {**_default_config(), "vocab_size": QWEN3_VOCAB_SIZE, "eos_token_id": 151643}
    out = _export(tmp_path / "export", config, tokenizer_dir)
    written = json.loads((out / "generation_config.json").read_text())
    # Qwen/Qwen3-0.6B's generation_config.json: eos [<|im_end|>, <|endoftext|>], pad <|endoftext|>.
    assert (written["eos_token_id"], written["pad_token_id"]) == ([151645, 151643], 151643)


def test_an_export_without_a_tokenizer_takes_the_generation_ids_from_config_json(tmp_path):
    config = {**_default_config(), "eos_token_id": 7, "pad_token_id": 5}
    out = _export(tmp_path / "export", config, assets_dir=None)
    written = json.loads((out / "generation_config.json").read_text())
    assert (written["eos_token_id"], written["pad_token_id"]) == (7, 5)


def test_a_source_generation_config_is_copied_unchanged_and_the_tokenizer_gets_the_models_length(tmp_path):
    source = make_tiny_checkpoint(tmp_path / "source")
    # What a published checkpoint ships: sampling settings of its own, written by transformers.
    GenerationConfig(
        eos_token_id=[2, 0], pad_token_id=0, do_sample=True, temperature=0.6, top_k=20, top_p=0.95
    ).save_pretrained(str(source))
    settings = json.loads((source / "tokenizer_config.json").read_text())
    settings["model_max_length"] = 131072  # published tokenizers say more than their model's positions
    (source / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    config = json.loads((source / "config.json").read_text())
    assert config["max_position_embeddings"] == 1024

    out = _export(tmp_path / "export", config, assets_dir=source)
    assert (out / "generation_config.json").read_bytes() == (source / "generation_config.json").read_bytes()
    assert json.loads((out / "tokenizer_config.json").read_text()) == {**settings, "model_max_length": 1024}
    assert AutoTokenizer.from_pretrained(str(out)).model_max_length == 1024
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (source / name).read_bytes(), name


def test_a_model_directory_without_tokenizer_files_still_gives_its_generation_config(tmp_path):
    source = make_tiny_checkpoint(tmp_path / "source", with_tokenizer=False)
    GenerationConfig(eos_token_id=[2, 0], pad_token_id=0, temperature=0.6, do_sample=True).save_pretrained(
        str(source)
    )
    config = json.loads((source / "config.json").read_text())
    # As the trainer plans it: the run's own tokenizer, the source's generation settings.
    out = _export(
        tmp_path / "export",
        config,
        assets_dir=default_tokenizer_dir(),
        generation_config=source / "generation_config.json",
    )
    assert (out / "generation_config.json").read_bytes() == (source / "generation_config.json").read_bytes()
    assert (out / "tokenizer.json").is_file()


@contextmanager
def _umask(mask: int):
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


def _modes(root) -> dict[str, int]:
    """Permission bits of ``root`` and of everything under it, by path relative to ``root``'s parent."""
    found = {root.name: stat.S_IMODE(root.stat().st_mode)}
    for path in root.rglob("*"):
        found[str(path.relative_to(root.parent))] = stat.S_IMODE(path.stat().st_mode)
    return found


@pytest.mark.parametrize(
    ("mask", "file_mode", "dir_mode"),
    [(0o022, 0o644, 0o755), (0o002, 0o664, 0o775)],
    ids=["umask-022", "umask-002"],
)
def test_every_exported_file_and_directory_gets_the_umask_modes(tmp_path, mask, file_mode, dir_mode):
    source = make_tiny_checkpoint(tmp_path / "source")
    (source / "tokenizer.json").chmod(0o600)  # a private model directory's modes are not the export's
    (source / "tokenizer_config.json").chmod(0o444)  # nor a read-only install's
    tensors = {f"t{i}": torch.randn(100, 100) for i in range(3)}  # 40 KB each in fp32: one file each
    config = json.loads((source / "config.json").read_text())
    adapter = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 64),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(128, 4),
    }
    with _umask(mask):
        out = _export(
            tmp_path / "hf" / "step-1",
            config,
            assets_dir=source,
            tensors=tensors,
            max_shard_bytes=45_000,
            model_card="# card\n",
        )
        # A second export replaces the first through the same rename: its modes too.
        out = _export(tmp_path / "hf" / "step-1", config, source, tensors, max_shard_bytes=45_000)
        spec = AdapterSpec(
            out_dir=tmp_path / "hf" / "adapter-step-1",
            params=LoRAParams(rank=4, alpha=8.0),
            target_modules=("q_proj",),
            base_model=str(source),
            step=1,
        )
        adapter_dir = write_adapter_dir(spec, adapter)
    exported = _modes(out)
    assert {
        "model-00001-of-00003.safetensors",
        "model.safetensors.index.json",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        EXPORT_MARKER,
    } <= {name.rpartition("/")[2] for name in exported}
    assert exported == {name: dir_mode if name == out.name else file_mode for name in exported}
    adapted = _modes(adapter_dir)
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md"} <= {
        name.rpartition("/")[2] for name in adapted
    }
    assert adapted == {name: dir_mode if name == adapter_dir.name else file_mode for name in adapted}
    # Nothing left beside them: no partial directory, no probe.
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["adapter-step-1", "step-1"]
    assert stat.S_IMODE((tmp_path / "hf").stat().st_mode) == dir_mode
