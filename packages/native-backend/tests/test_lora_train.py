"""LoRA through the real launcher: published-style weights in, an adapter peft loads out.

Every run is the real ``train`` command on the CPU in fp32; the trained model is read back from its
step checkpoint (``qwen3_titan_testing.trained``) and compared with what peft and transformers make of
the exported files.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import peft
import pytest
import torch
from qwen3_titan_common.perf.train_log import parse_step_lines
from qwen3_titan_common.train.tolerance import ModelBounds
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint
from qwen3_titan_testing.edges import check_failure, checks_in_process
from qwen3_titan_testing.trained import load_trained_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

TRAIN = str(Path(sys.executable).with_name("train"))
ENV = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": "native-backend"}
EXACT = ["--training.mixed_precision_param", "float32", "--debug.seed", "0", "--debug.deterministic"]
LORA = ["--lora.rank", "4", "--lora.alpha", "8", "--lora.targets", "q_proj,v_proj,o_proj,up_proj,down_proj"]
STEPS = 8
SCALING = 8 / 4
PRINTED_LOSS = 0.5e-5  # a step line's loss has 5 decimals
EVAL_SEQ_LEN = 256  # eval's default --seq-len


def _logit_bound(model_dir: Path) -> float:
    """Two fp32 implementations of one model's logits on ``_tokens()``: the derived bound (tolerance module)."""
    return ModelBounds.from_dir(model_dir).logit_atol(seq_len=_tokens().shape[1])


def _train(args, cwd):
    proc = subprocess.run([TRAIN, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _run_printed(log: str, cwd: Path, names=("verify", "load")) -> dict[str, str]:
    """Run the summary's commands as printed (relative to the run's directory); their output."""
    import shlex

    outputs = {}
    for name in names:
        (line,) = [x for x in log.splitlines() if x.startswith(f"[train] {name}:")]
        command = shlex.split(line.split(":", 1)[1].split("   (")[0])
        if command[0] in ("verify-checkpoint", "train"):
            command[0] = str(Path(sys.executable).with_name(command[0]))
        proc = subprocess.run(command, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{line}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        outputs[name] = proc.stdout if name != "resume" else proc.stdout + proc.stderr
    return outputs


def _eval(*args: str, cwd: Path) -> dict:
    command = [str(Path(sys.executable).with_name("eval")), *args, "--json", "--max-batches", "2"]
    proc = subprocess.run(command, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(proc.stdout)


def _tokens(vocab=4096):
    return torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    source = make_tiny_checkpoint(tmp / "source")
    args = ["--hf-model", str(source), "--training.seq_len", "128", *LORA, *EXACT]
    out = tmp / "out"
    log = _train([*args, "--training.steps", str(STEPS), "--lora.merge", "--dump_folder", str(out)], tmp)
    titan_args = ["--module", "qwen3_titan_native", "--config", "debug", "--hf.model_dir", str(source), *LORA]
    return source, out, log, titan_args


@pytest.mark.slow
def test_peft_loads_the_adapter_onto_the_base_and_computes_the_trained_model(lora_run):
    source, out, log, titan_args = lora_run
    adapter = out / "hf" / f"adapter-step-{STEPS}"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(source.resolve())
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    assert sorted(config["target_modules"]) == ["down_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    # The start line: what trains and what the optimizer holds (AdamW: 2 fp32 moments per adapter value).
    # rank 4 on hidden 64, q 4x32, k/v 2x32, MLP 128: A (4, in) + B (out, 4) per projection, 2 layers.
    per_layer = {"q_proj": (64, 128), "v_proj": (64, 64), "o_proj": (128, 64), "up_proj": (64, 128)}
    per_layer["down_proj"] = (128, 64)
    trainable = 2 * sum(4 * (fan_in + fan_out) for fan_in, fan_out in per_layer.values())
    assert f"[params] trainable {trainable:,} of " in log
    assert f"optimizer state per rank {8 * trainable:,} bytes" in log

    trained = load_trained_model(titan_args, out / "checkpoint" / f"step-{STEPS}")
    base = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base, str(adapter)).eval()
    lora_b = [p for n, p in with_adapter.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.abs().max() > 0 for p in lora_b)  # trained away from peft's zero init
    with torch.no_grad():
        ours, theirs = trained(_tokens()), with_adapter(_tokens()).logits
    # The merged export's logit scale is the adapted model's (the adapters change no norm and no lm_head).
    assert (ours - theirs).abs().max().item() <= _logit_bound(out / "hf" / f"step-{STEPS}")


@pytest.mark.slow
def test_base_weights_are_untouched_and_the_merged_export_is_base_plus_scaled_b_a(lora_run):
    source, out, _, titan_args = lora_run
    base = load_file(source / "model.safetensors")
    trained, config = load_trained_model(titan_args, out / "checkpoint" / f"step-{STEPS}", with_config=True)
    # The checkpoint's base weights in Hugging Face names (the run's own state-dict adapter, adapters left out).
    to_hf = config.model_spec.state_dict_adapter(config.model_spec.model, None).to_hf
    in_hf = to_hf(trained.state_dict())
    assert in_hf.keys() == base.keys()
    for key, tensor in base.items():
        assert torch.equal(in_hf[key], tensor), key  # bit-identical after training

    adapter = load_file(out / "hf" / f"adapter-step-{STEPS}" / "adapter_model.safetensors")
    merged = load_file(out / "hf" / f"step-{STEPS}" / "model.safetensors")
    assert merged.keys() == base.keys()
    adapted = 0
    for key, tensor in base.items():
        module = f"base_model.model.{key.removesuffix('.weight')}"
        if f"{module}.lora_A.weight" not in adapter:
            assert torch.equal(merged[key], tensor), key
            continue
        a, b = adapter[f"{module}.lora_A.weight"], adapter[f"{module}.lora_B.weight"]
        assert torch.allclose(merged[key], tensor + (b @ a) * SCALING, rtol=0, atol=1e-6), key
        assert not torch.allclose(merged[key], tensor, rtol=0, atol=1e-6), key
        adapted += 1
    assert adapted == 2 * 5  # 2 layers x 5 targets
    # peft's own merge of the adapter gives the same weights.
    peft_merged = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32),
        str(out / "hf" / f"adapter-step-{STEPS}"),
    ).merge_and_unload()
    compared = 0
    for key, tensor in peft_merged.state_dict().items():
        if key in merged:
            assert torch.allclose(merged[key], tensor, rtol=0, atol=1e-6), key
            compared += 1
    assert compared == len(merged)


@pytest.mark.slow
def test_training_continues_from_an_exported_adapter(lora_run, tmp_path):
    source, out, first_log, _ = lora_run
    adapter = out / "hf" / f"adapter-step-{STEPS}"
    log = _train(
        ["--hf-model", str(source), "--training.seq_len", "128", *EXACT, "--lora.adapter", str(adapter),
         "--training.steps", "1", "--dump_folder", str(tmp_path / "next")],
        tmp_path,
    )  # fmt: skip
    assert f"[lora] continuing from the adapter in {adapter}" in log
    assert f"rank 4, alpha 8, targets down_proj,o_proj,q_proj,up_proj,v_proj from {adapter}" in log
    # The first batch is the first run's first batch: its loss is now the adapted model's on it.
    first = parse_step_lines(first_log)[0].loss
    continued = parse_step_lines(log)[0].loss
    from qwen3_titan_native.config_registry import debug

    config = debug()
    tokenizer = config.tokenizer.build(tokenizer_path=str(source))
    loader = config.dataloader.build(
        dp_world_size=1,
        dp_rank=0,
        tokenizer=tokenizer,
        seq_len=128,
        local_batch_size=config.training.local_batch_size,
    )
    inputs, labels = next(iter(loader))
    model = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32), str(adapter)
    ).eval()
    with torch.no_grad():
        # Each document scored alone, as training scores it (transformers' packed rows).
        logits = model(inputs["input"], position_ids=inputs["positions"], use_cache=False).logits
    expected = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=-100
    ).item()
    print(f"first-batch loss: base {first:.5f}, with the adapter {continued:.5f} (peft: {expected:.5f})")
    # The merged export is the adapted model the continued run starts from.
    bounds = ModelBounds.from_dir(out / "hf" / f"step-{STEPS}")
    bound = bounds.loss_atol(expected, tokens=int((labels != -100).sum()), seq_len=128)
    assert abs(continued - expected) <= bound + PRINTED_LOSS
    assert abs(continued - first) > 1e-3


@pytest.mark.slow
def test_lora_on_the_embedded_default_lowers_the_loss_and_exports_its_base(tmp_path):
    # The README's LoRA command (its 30 steps run in tests/test_readme.py), at 12 steps: 8.297 -> 7.794 here.
    log = _train(
        ["--lora.rank", "16", "--steps", "12", *EXACT, "--dump_folder", str(tmp_path / "out")], tmp_path
    )
    losses = [s.loss for s in parse_step_lines(log)]
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    print(f"LoRA rank 16 on the embedded default: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert losses[-1] < losses[0] - 0.25
    base = tmp_path / "out" / "hf" / "base"
    adapter = tmp_path / "out" / "hf" / "adapter-step-12"
    assert not (tmp_path / "out" / "hf" / "step-12").exists()  # no --lora.merge: no full export
    assert "Exported the frozen base model (training leaves it unchanged)" in log
    outputs = _run_printed(log, tmp_path)  # the adapter's own commands: verify on its base, load through peft
    assert outputs["verify"].rstrip().endswith("OK") and "peft LoRA adapter" in outputs["verify"]
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
    trained = load_trained_model(
        ["--module", "qwen3_titan_native", "--config", "debug", "--lora.rank", "16"],
        tmp_path / "out" / "checkpoint" / "step-12",
    )
    model = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), str(adapter)
    )
    with torch.no_grad():
        difference = (trained(_tokens()) - model.eval()(_tokens()).logits).abs().max().item()
    assert difference <= _logit_bound(base)


@pytest.mark.slow
def test_a_merged_run_summary_names_each_folder_and_its_commands_work(lora_run):
    source, out, log, _ = lora_run
    # Paths as the summary shows them: relative to the directory the run was started in.
    assert f"[train] adapter:    out/hf/adapter-step-{STEPS}   (peft LoRA, on the base {source.name})" in log
    assert f"[train] export:     out/hf/step-{STEPS}   (base + adapters merged)" in log
    assert f"Exported the merged model (base + adapters) of step {STEPS}" in log
    outputs = _run_printed(log, out.parent, names=("verify", "load", "resume"))
    assert outputs["verify"].rstrip().endswith("OK")
    assert "Qwen3ForCausalLM" in outputs["load"]
    assert f"[train] done: steps {STEPS + 1}-{2 * STEPS} of {2 * STEPS}" in outputs["resume"]


@pytest.mark.slow
def test_eval_and_verify_take_the_adapter_folder(lora_run):
    source, out, _, _ = lora_run
    adapter, merged = out / "hf" / f"adapter-step-{STEPS}", out / "hf" / f"step-{STEPS}"
    on_base = _eval(str(adapter), cwd=out.parent)["results"][0]
    as_merged = _eval(str(merged), cwd=out.parent)["results"][0]
    base = _eval(str(source), cwd=out.parent)["results"][0]
    # The adapter as a side branch (peft) or merged into the weights (fp32): one model, the derived bound.
    bound = ModelBounds.from_dir(merged).loss_atol(
        as_merged["loss"], tokens=as_merged["tokens"], seq_len=EVAL_SEQ_LEN
    )
    assert abs(on_base["loss"] - as_merged["loss"]) <= bound, (on_base, as_merged, bound)
    assert abs(on_base["loss"] - base["loss"]) > 1e-4  # the adapter changed the model: the check can fail
    verify = str(Path(sys.executable).with_name("verify-checkpoint"))
    proc = subprocess.run([verify, str(adapter)], env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "logits max |peft - torchtitan|" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stdout.rstrip().endswith("OK")


@pytest.mark.slow
def test_verify_names_the_adapter_tensor_that_does_not_fit_the_base(lora_run, tmp_path):
    import shutil

    from qwen3_titan_testing.edges import check_failure
    from safetensors.torch import save_file

    source, out, _, _ = lora_run
    adapter = Path(shutil.copytree(out / "hf" / f"adapter-step-{STEPS}", tmp_path / "adapter"))
    tensors = load_file(adapter / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors[key] = tensors[key][:, :32].contiguous()  # the base's hidden size is 64
    save_file(tensors, adapter / "adapter_model.safetensors")
    verify = str(Path(sys.executable).with_name("verify-checkpoint"))
    proc = subprocess.run([verify, str(adapter)], env=ENV, capture_output=True, text=True, timeout=600)
    check_failure(
        proc.returncode, proc.stdout, proc.stderr, 2, key, "expected [4, 64]", prefix="verify-checkpoint:"
    )


@pytest.mark.slow
def test_resuming_across_full_and_lora_runs_is_refused_in_one_line_either_way(tmp_path, monkeypatch, capfd):
    # Before any rank loads: the checkpoint folder's model record says what its step checkpoints hold (the
    # refusals checked in this process, as rank 0 checks them before it writes anything).
    from qwen3_titan_native import BACKEND

    monkeypatch.setenv("QWEN3_TITAN_DEVICE", "cpu")
    monkeypatch.chdir(tmp_path)
    for first, refusals in (
        ([], [(["--lora.rank", "4"], "are a full fine-tuning run's, and this run trains LoRA adapters")]),
        (
            ["--lora.rank", "4"],
            [
                ([], "hold LoRA adapters (--lora.rank 4 --lora.targets"),
                (["--lora.rank", "8"], "hold LoRA adapters of --lora.rank 4"),
            ],
        ),
    ):
        dump = tmp_path / f"out-{len(first)}"
        _train(["--training.steps", "2", "--training.seq_len", "64", "--hf.no-export", "--dump_folder", str(dump),
                *first], tmp_path)  # fmt: skip
        for then, said in refusals:
            capfd.readouterr()
            argv = ["--training.steps", "3", "--training.seq_len", "64", *then, "--dump_folder", str(dump)]
            rc = checks_in_process(BACKEND, argv)
            out = capfd.readouterr()
            check_failure(rc, out.out, out.err, 2, said, "--dump_folder")
            assert not (dump / "checkpoint" / "step-3").exists()
