"""LoRA on every backend, two CPU ranks (FSDP2 over gloo), through the real launcher.

Each backend trains the tiny checkpoint's adapters (the nki-moe backend a tiny Qwen3-MoE's, whose
routed experts stay frozen and unadapted), and the adapter it exports, loaded by
``peft.PeftModel.from_pretrained`` onto the untouched base in transformers, computes the trained model
read back from its step checkpoint.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import peft
import pytest
import torch
from qwen3_titan_common.models.lora import adapter_key
from qwen3_titan_common.perf.train_log import parse_step_lines
from qwen3_titan_common.train.tolerance import ModelBounds
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint
from qwen3_titan_testing.trained import load_trained_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

TRAIN = str(Path(sys.executable).with_name("train"))
STEPS = 6
LORA = ["--lora.rank", "4", "--lora.alpha", "8", "--lora.dropout", "0.1"]
BACKENDS = {
    "native-backend": ("qwen3_titan_native", "debug", False),
    "hf-v5-backend": ("qwen3_titan_hf_v5", "debug", False),
    "nki-moe-backend": ("qwen3_titan_nki_moe", "debug_moe", True),
}


@pytest.mark.slow
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_two_ranks_train_an_adapter_that_peft_loads(tmp_path, backend):
    module, config, moe = BACKENDS[backend]
    source = make_tiny_checkpoint(tmp_path / "source", moe=moe, tied=not moe)
    env = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": backend, "OMP_NUM_THREADS": "1"}
    flags = ["--hf.model_dir", str(source), *LORA]
    command = [
        TRAIN, "--nproc_per_node", "2", "--config", config, *flags, "--training.steps", str(STEPS),
        "--training.seq_len", "64", "--training.mixed_precision_param", "float32", "--debug.seed", "0",
        "--dump_folder", str(tmp_path / "out"),
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "dp_shard=2" in log, log[-4000:]
    assert len(parse_step_lines(log)) == STEPS

    adapter_dir = tmp_path / "out" / "hf" / f"adapter-step-{STEPS}"
    targets = json.loads((adapter_dir / "adapter_config.json").read_text())["target_modules"]
    expected = ["k_proj", "o_proj", "q_proj", "v_proj"] + (
        [] if moe else ["down_proj", "gate_proj", "up_proj"]
    )
    assert sorted(targets) == sorted(expected)
    if moe:
        assert "[lora] Qwen3-MoE: gate_proj,up_proj,down_proj not adapted" in log
        assert not [k for k in load_file(adapter_dir / "adapter_model.safetensors") if "mlp" in k]

    trained, run_config = load_trained_model(
        ["--module", module, "--config", config, *flags], tmp_path / "out" / "checkpoint" / f"step-{STEPS}",
        with_config=True,
    )  # fmt: skip
    base = load_file(source / "model.safetensors")
    to_hf = run_config.model_spec.state_dict_adapter(run_config.model_spec.model, None).to_hf
    in_hf = to_hf({k: v for k, v in trained.state_dict().items() if adapter_key(k) is None})
    assert in_hf.keys() == base.keys()
    assert all(torch.equal(in_hf[key], tensor) for key, tensor in base.items())  # the base never moved

    model = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32), str(adapter_dir)
    ).eval()
    assert all(p.abs().max() > 0 for n, p in model.named_parameters() if "lora_B" in n)
    tokens = torch.randint(0, 4096, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (trained(tokens) - model(tokens).logits).abs().max().item()
    print(f"{backend}: max |logits(trained) - logits(peft)| = {diff:.2e}")
    # Two fp32 implementations of one model (the adapters touch neither the final norm nor the output layer).
    assert diff <= ModelBounds.from_dir(source).logit_atol(seq_len=tokens.shape[1])
