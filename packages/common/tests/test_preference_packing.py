"""Packed preference pairs on torchtitan's Qwen3 (the native model, as ``eval`` builds it): the prompt computed once
gives every completion the log-probabilities it has in a sequence of its own, and nothing leaks between pairs or
from the chosen completion into the rejected one.

The rows come from the real dataloader: pairs packed several to a row with the prompt shared, and one pair per row
as two sequences (``--dataloader.no-packing``).
"""

import json

import pytest
import torch
from qwen3_titan_common.arch.architecture import architecture_from_config
from qwen3_titan_common.assets import default_tokenizer_dir
from qwen3_titan_common.components.preference import PairLayout
from qwen3_titan_common.data import TextChatDataLoader
from qwen3_titan_common.scripts.eval import eval_model_builder
from qwen3_titan_testing.checkpoints import tiny_qwen3_config
from qwen3_titan_testing.packed import ATOL
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.tokenizer import HuggingFaceTokenizer

SEQ_LEN = 256
PAIRS = 12


def _records():
    return [
        {
            "prompt": f"Question {i}: what does the fox number {i} do " + "and then " * (i % 4) + "?",
            "chosen": f" It jumps over {i % 5} lazy dogs" + ", quickly" * (i % 3) + ".",
            "rejected": f" It sleeps {i} hours" + " all day" * (i % 2) + ".",
        }
        for i in range(PAIRS)
    ]


def _batch(path, **loader):
    tokenizer = HuggingFaceTokenizer.Config().build(tokenizer_path=str(default_tokenizer_dir()))
    config = TextChatDataLoader.Config(dataset=str(path), shuffle=False, infinite=False, **loader)
    rows = []
    for inputs, _ in config.build(
        dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=SEQ_LEN, local_batch_size=1
    ):
        rows.append(inputs)
    return {key: torch.cat([r[key] for r in rows]) for key in rows[0]}


def _pair_logps(model, batch):
    """Per record: the summed log-probabilities of its chosen and rejected completions, (records, 2)."""
    with torch.no_grad():
        logits = model(batch["input"], batch["positions"])
    logp = torch.log_softmax(logits.double(), dim=-1)
    targets = batch["dpo_targets"]
    layout = PairLayout.of(targets, batch["positions"], batch["dpo_records"])
    token = logp[layout.trained_BL].gather(1, targets[layout.trained_BL][:, None])[:, 0]
    sums = layout.sums(token)
    out = torch.full((PAIRS, 2), float("nan"), dtype=torch.float64)
    out[layout.records_P] = sums
    counts = torch.zeros(PAIRS, 2, dtype=torch.float64)
    counts[layout.records_P] = layout.sums(torch.ones_like(token))
    return out, counts


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _records()))
    arch = architecture_from_config(tiny_qwen3_config(vocab_size=4096).to_dict())
    torch.manual_seed(0)
    model = eval_model_builder(None)[0](arch, None, dtype=torch.float32, seq_len=SEQ_LEN, seed=0)
    shared = _batch(path, share_prompt=True)
    repeated = _batch(path, packing=False)
    return model, shared, repeated


def _bound(counts):
    """A completion's sum of log-probabilities: each token's within twice the logits' bound (log-sum-exp moves
    by at most the largest logit's error), summed over its tokens."""
    return counts * 2 * ATOL


def test_shared_prompt_packs_several_pairs_a_row_in_fewer_tokens(setup):
    _, shared, repeated = setup
    assert shared["input"].shape[0] < PAIRS // 2  # several pairs to a row
    assert repeated["input"].shape[0] == PAIRS  # one pair per row
    # The rejected completions continue their prompt: positions that neither restart nor go on.
    positions = shared["positions"]
    continued = (positions[:, 1:] != positions[:, :-1] + 1) & (positions[:, 1:] != 0)
    assert int(continued.sum()) == PAIRS
    trained = (shared["dpo_targets"] != IGNORE_INDEX).sum()
    assert trained == (repeated["dpo_targets"] != IGNORE_INDEX).sum()


def test_shared_prompt_gives_each_completion_its_own_log_probabilities(setup):
    model, shared, repeated = setup
    got, counts = _pair_logps(model, shared)
    want, _ = _pair_logps(model, repeated)
    assert not torch.isnan(got).any() and not torch.isnan(want).any()
    assert ((got - want).abs() <= _bound(counts)).all(), (got - want).abs().max()


def test_a_token_changed_in_one_pair_changes_only_that_completion(setup):
    model, shared, _ = setup
    before, counts = _pair_logps(model, shared)
    targets, records = shared["dpo_targets"], shared["dpo_records"]
    positions = shared["positions"]
    # The first trained token of record 1's chosen completion: its input (the token after it) changes.
    row, column = [int(x) for x in ((records == 1) & (targets != IGNORE_INDEX)).nonzero()[0]]
    assert positions[row, column + 1] == positions[row, column] + 1  # still the chosen completion
    probed = {key: value.clone() for key, value in shared.items()}
    probed["input"][row, column + 1] = (probed["input"][row, column + 1] + 1) % 4096
    after, _ = _pair_logps(model, probed)
    changed = (after - before).abs() > _bound(counts)
    assert changed[1, 0], "the chosen completion did not change: the probe tests nothing"
    changed[1, 0] = False
    assert not changed.any(), f"changed elsewhere: {changed.nonzero().tolist()}"
