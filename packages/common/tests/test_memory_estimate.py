"""The step memory estimate (``perf.memory``): torch's tracker over two fake steps, grouped as the dry run
prints it. The estimate against measured runs is ``tools/bench_memory.py`` (docs/performance.md)."""

from __future__ import annotations

import torch
from qwen3_titan_common.perf.memory import GIB, StepMemory, grouped, process_baseline_bytes, track_step

VOCAB, HIDDEN, BATCH, SEQ = 4096, 256, 4, 64


def _model():
    # On the meta device, as the dry run builds a job's model: no storage; the step makes its tensors fake.
    with torch.device("meta"):
        return torch.nn.Sequential(torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.Linear(HIDDEN, VOCAB))


def _step(batch: int) -> StepMemory:
    return track_step(
        _model, lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3), batch=batch, seq_len=SEQ,
        vocab_size=VOCAB, baseline_bytes=123,
    )  # fmt: skip


def test_a_step_holds_the_parameters_the_optimizer_state_and_the_logits():
    params = 4 * (VOCAB * HIDDEN + HIDDEN * VOCAB + VOCAB)  # fp32
    small = _step(BATCH)
    # Both AdamW moments (and one 4-byte step count per parameter) at the peak, which is at least the end of the
    # optimizer step: parameters, every gradient and the moments.
    assert small.by_kind["params"] == params
    assert small.by_kind["optimizer"] == 2 * params + 4 * 3
    assert small.step_bytes >= 4 * params
    assert small.total_bytes == small.step_bytes + 123
    assert "params 0.01" in small.describe() and "process 0.00" in small.describe()
    # 64 rows: the logits (64 x 64 x 4096 fp32 = 64 MiB) and their gradient outweigh the 8 MiB of weights; the
    # peak is in the backward, before any parameter has its gradient, with the moments of the first step.
    large = _step(64)
    logits = 4 * 64 * SEQ * VOCAB
    assert large.by_kind["params"] == params and large.by_kind["grads"] == 0
    assert large.by_kind["optimizer"] == 2 * params + 4 * 3
    assert large.by_kind["activations"] >= 2 * logits
    assert large.step_bytes > small.step_bytes


class _LanguageModel(torch.nn.Module):
    """An embedding and an output projection that returns its hidden states when a chunked loss applies it."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens):
        from qwen3_titan_common.compat import lm_head_applied_by_loss

        hidden = self.embed(tokens)
        return hidden if lm_head_applied_by_loss(self) else self.lm_head(hidden)


def _meta_language_model():
    with torch.device("meta"):
        return _LanguageModel()


def test_a_chunked_loss_holds_one_chunk_of_logits():
    # The CPU's loss projects a quarter of the tokens at a time: 64 rows' logits (64 MiB, the step's largest
    # tensor with their gradient) a quarter as large; the weights and moments unchanged.
    def step(loss_chunks):
        return track_step(
            _meta_language_model, lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3), batch=64, seq_len=SEQ,
            vocab_size=VOCAB, baseline_bytes=0, loss_chunks=loss_chunks,
        )  # fmt: skip

    whole, chunked = step(None), step(4)
    logits = 4 * 64 * SEQ * VOCAB
    assert whole.by_kind["activations"] >= 2 * logits
    assert chunked.by_kind["activations"] < whole.by_kind["activations"] - logits
    assert chunked.by_kind["optimizer"] == whole.by_kind["optimizer"]


def test_grouped_sums_the_trackers_kinds():
    kinds = {"Sharded Param": 10, "Buffer": 1, "Sharded Grad": 5, "OptState": 20, "Activation": 7, "Temp": 3,
             "Unsharded Param": 2, "Reduce Scatter": 4, "Something New": 9}  # fmt: skip
    assert grouped(kinds) == {"params": 11, "grads": 5, "optimizer": 20, "activations": 19, "FSDP buffers": 6}


def test_the_process_baseline_is_host_memory_on_the_cpu_only():
    on_cpu = process_baseline_bytes("cpu")
    assert 50 * 1024**2 < on_cpu < 8 * GIB  # this interpreter with torch imported
    assert process_baseline_bytes("cuda") == 0 and process_baseline_bytes("neuron") == 0
