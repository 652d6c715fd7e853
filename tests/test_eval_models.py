"""Every backend's ``eval`` model is built by one function from the backend's model spec, and holds the
checkpoint's weights: its logits are transformers' on the same directory (tied and untied, sharded, dense and
MoE), within the bound of two computations of one forward, and a tied checkpoint gives one shared parameter."""

from __future__ import annotations

import pytest
import torch
from qwen3_titan_common.hf.model_dir import open_model_dir
from qwen3_titan_common.scripts.eval import eval_model_builder
from qwen3_titan_common.train.tolerance import ModelBounds
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint
from transformers import AutoModelForCausalLM

SEQ = 16
BACKENDS = {"native": None, "hf-v5": "hf-v5-backend", "nki-moe": "nki-moe-backend"}


CHECKPOINTS = {"dense-tied": (False, True), "moe-untied": (True, False), "moe-yarn": (True, False)}
# Qwen3's long-context setting as its model cards write it, scaled to the tiny model's positions.
YARN = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}}
# nki-moe-backend trains Qwen3-MoE only.
CASES = [
    (backend, kind)
    for kind in CHECKPOINTS
    for backend in BACKENDS
    if backend != "nki-moe" or kind.startswith("moe")
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    # Shards small enough that a layer's tensors (and the tied pair) fall in different files.
    return {
        kind: make_tiny_checkpoint(
            tmp_path_factory.mktemp(kind) / "m",
            moe=moe,
            tied=tied,
            max_shard_size="200KB",
            config_changes=YARN if kind.endswith("yarn") else None,
        )
        for kind, (moe, tied) in CHECKPOINTS.items()
    }


@pytest.mark.parametrize(("backend", "kind"), CASES)
def test_each_backend_s_eval_model_holds_the_checkpoint(checkpoints, backend, kind):
    path, tied = checkpoints[kind], CHECKPOINTS[kind][1]
    weights = open_model_dir(str(path))
    assert len(weights.weight_files) > 1
    tokens = torch.randint(
        1, weights.architecture.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0)
    )
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    build = eval_model_builder(BACKENDS[backend])[0]
    model = build(weights.architecture, weights, dtype=torch.float32, seq_len=SEQ)
    with torch.no_grad():
        ours = model(tokens, torch.arange(SEQ).repeat(2, 1))
        theirs = reference(tokens).logits
    bound = ModelBounds.from_dir(path).logit_atol(seq_len=SEQ, passes=2)
    assert (ours - theirs).abs().max().item() <= bound
    assert (model.lm_head.weight is model.tok_embeddings.weight) == tied
