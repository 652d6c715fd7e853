"""Preference pairs (data.preference) and the DPO loss (components.preference).

The loss is checked against a direct computation: whole logits, log-softmax, summed completion log-probabilities,
the DPO formula and autograd, in float64 so that the two differ only by the order of float64 sums.
"""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from qwen3_titan_common import compat
from qwen3_titan_common.assets import default_tokenizer_dir
from qwen3_titan_common.components.preference import (
    PairLayout,
    PreferenceBatch,
    PreferenceLoss,
    PreferenceOptions,
)
from qwen3_titan_common.data import TextChatDataLoader
from qwen3_titan_common.data.chat import ChatTokenizer
from qwen3_titan_common.data.preference import PreferenceTokenizer, pair_markers
from qwen3_titan_common.data.records import InvalidRecord
from qwen3_titan_common.data.tokens import DocumentTokenizer
from qwen3_titan_common.errors import UserInputError
from qwen3_titan_common.train.preference import ReferenceLogps
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.tokenizer import HuggingFaceTokenizer

SEQ_LEN = 128


@pytest.fixture(scope="module")
def tokens():
    return DocumentTokenizer(HuggingFaceTokenizer.Config().build(tokenizer_path=str(default_tokenizer_dir())))


@pytest.fixture(scope="module")
def pairs(tokens):
    return PreferenceTokenizer(tokens, ChatTokenizer(tokens))


def _decode(tokens, ids):
    return tokens.base.decode([int(i) for i in ids])


def test_string_pair_trains_the_completion_and_eos(tokens, pairs):
    pair = pairs.pair({"prompt": "What is 2+2?", "chosen": " 4", "rejected": " 5"}, SEQ_LEN)
    for side, text in ((pair.chosen, " 4"), (pair.rejected, " 5")):
        assert side.ids[-1] == tokens.eos_id
        assert _decode(tokens, side.ids[side.trained][:-1]) == text
        assert not side.trained[: len(side.ids) - side.trained.sum()].any()  # the prompt is not trained
    document = pair.document(tokens.eos_id, record=7)
    chosen_len = len(pair.chosen.ids) - 1
    assert document.positions.tolist() == [*range(chosen_len), *range(len(pair.rejected.ids) - 1)]
    assert set(document.records.tolist()) == {7}
    assert (document.labels != IGNORE_INDEX).sum() == pair.chosen.trained.sum() + pair.rejected.trained.sum()


def test_implicit_prompt_is_the_shared_beginning(pairs):
    prompt = [{"role": "user", "content": "Name a colour."}]
    good, bad = [{"role": "assistant", "content": "Blue."}], [{"role": "assistant", "content": "Seven."}]
    explicit = pairs.pair({"prompt": prompt, "chosen": good, "rejected": bad}, SEQ_LEN)
    implicit = pairs.pair({"chosen": prompt + good, "rejected": prompt + bad}, SEQ_LEN)
    for a, b in ((explicit.chosen, implicit.chosen), (explicit.rejected, implicit.rejected)):
        assert np.array_equal(a.ids, b.ids) and np.array_equal(a.trained, b.trained)
    assert explicit.chosen.trained.any() and not explicit.identical
    strings = pairs.pair({"chosen": "The sky is blue.", "rejected": "The sky is green."}, SEQ_LEN)
    assert not np.array_equal(strings.chosen.ids, strings.rejected.ids)


def test_message_completion_trains_only_its_own_turn(tokens, pairs):
    prompt = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    pair = pairs.pair(
        {
            "prompt": prompt,
            "chosen": [{"role": "assistant", "content": "Goodbye!"}],
            "rejected": [{"role": "assistant", "content": "No."}],
        },
        SEQ_LEN,
    )
    trained = _decode(tokens, pair.chosen.ids[pair.chosen.trained])
    assert "Goodbye!" in trained and "Hello." not in trained


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        ({"prompt": "Q", "chosen": "A"}, "field 'rejected' missing"),
        ({"prompt": "Q", "chosen": "A", "rejected": "   "}, "field 'rejected' is an empty completion"),
        ({"prompt": "Q", "chosen": "A", "rejected": 3}, "field 'rejected' is a number"),
        (
            {"prompt": [{"role": "user", "content": "Q"}], "chosen": "A", "rejected": "B"},
            "mix strings and message",
        ),
        (
            {
                "prompt": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
                "chosen": [{"role": "assistant", "content": "B"}],
                "rejected": [{"role": "assistant", "content": "C"}],
            },
            "ends with an assistant turn",
        ),
        ({"chosen": "Apples", "rejected": "Pears"}, "share no beginning"),
        (
            {
                "chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                "rejected": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}],
            },
            "share no first message",
        ),
        ({"prompt": "Q", "chosen": "word " * 200, "rejected": "B"}, "longer than a row"),
        (
            {
                "prompt": [{"role": "user", "content": "Q"}],
                "chosen": [{"role": "user", "content": "B"}],
                "rejected": [{"role": "assistant", "content": "C"}],
            },
            "field 'chosen' has no assistant turn",
        ),
    ],
)
def test_bad_pairs_are_one_line_naming_the_field(pairs, record, expected):
    with pytest.raises(InvalidRecord) as err:
        pairs.pair(record, SEQ_LEN)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_rows_of_pairs_mark_one_token_per_pair(tmp_path, tokens):
    records = [{"prompt": f"Question {i}?", "chosen": f" yes {i}", "rejected": f" no {i}"} for i in range(20)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    loader = TextChatDataLoader.Config(dataset=str(path), shuffle=False, infinite=False).build(
        dp_world_size=1, dp_rank=0, tokenizer=tokens.base, seq_len=SEQ_LEN, local_batch_size=2
    )
    seen = []
    for inputs, markers in loader:
        targets, positions, rows = inputs["dpo_targets"], inputs["positions"], inputs["dpo_records"]
        layout = PairLayout.of(targets, positions, rows)
        assert int((markers != IGNORE_INDEX).sum()) == layout.pairs
        for row in range(targets.shape[0]):
            np.testing.assert_array_equal(
                pair_markers(targets[row].numpy(), positions[row].numpy()), markers[row].numpy()
            )
        seen += layout.records_P.tolist()
    assert sorted(seen) == list(range(20))  # every pair once, whole


# -- the loss ---------------------------------------------------------------------------------------


def _batch(generator, vocab, rows, length, pairs_per_row):
    """Rows of ``pairs_per_row`` pairs (chosen, rejected sequences of random lengths), then padding."""
    targets = torch.full((rows, length), IGNORE_INDEX)
    positions = torch.zeros(rows, length, dtype=torch.int64)
    records = torch.full((rows, length), -1)
    record = 0
    for row in range(rows):
        at = 0
        for _ in range(pairs_per_row):
            for _side in range(2):
                n = int(torch.randint(4, 9, (1,), generator=generator))
                prompt = int(torch.randint(1, 4, (1,), generator=generator))
                positions[row, at : at + n] = torch.arange(n)
                targets[row, at + prompt : at + n] = torch.randint(
                    0, vocab, (n - prompt,), generator=generator
                )
                records[row, at : at + n] = record
                at += n
            record += 1
        positions[row, at:] = torch.arange(length - at)
    return PreferenceBatch(targets, records, positions), record


def _direct(hidden, weight, batch, reference, options):
    """DPO from whole logits and autograd."""
    logp = torch.log_softmax(hidden @ weight.T, dim=-1)
    trained = batch.targets_BL != IGNORE_INDEX
    token = logp[trained].gather(1, batch.targets_BL[trained][:, None])[:, 0]
    layout = PairLayout.of(batch.targets_BL, batch.positions_BL, batch.records_BL)
    policy = layout.sums(token)
    counts = layout.sums(torch.ones_like(token))
    ref = reference[layout.records_P]
    if options.loss_type == "ipo":
        h = (policy / counts - ref / counts) @ torch.tensor([1.0, -1.0], dtype=policy.dtype)
        losses = (h - 1 / (2 * options.beta)) ** 2
    else:
        h = (policy - ref) @ torch.tensor([1.0, -1.0], dtype=policy.dtype)
        s = options.label_smoothing
        losses = -(1 - s) * F.logsigmoid(options.beta * h) - s * F.logsigmoid(-options.beta * h)
    losses = losses - options.sft_weight * policy[:, 0] / counts[:, 0]
    return losses.sum() / layout.pairs


@pytest.mark.parametrize("fixed_shapes", [False, True], ids=["per-batch", "fixed-shapes"])
@pytest.mark.parametrize(
    "options",
    [
        PreferenceOptions(),
        PreferenceOptions(beta=0.5, label_smoothing=0.2),
        PreferenceOptions(loss_type="ipo", beta=0.3),
        PreferenceOptions(sft_weight=0.7),
    ],
    ids=["sigmoid", "smoothed", "ipo", "sft"],
)
def test_loss_and_gradients_equal_the_direct_computation(options, fixed_shapes):
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    vocab, dim, rows, length = 50, 16, 3, 48
    batch, records = _batch(generator, vocab, rows, length, pairs_per_row=2)
    weight = torch.randn(vocab, dim, dtype=torch.float64, requires_grad=True)
    hidden = torch.randn(rows, length, dim, dtype=torch.float64, requires_grad=True)
    reference = torch.randn(records, 2, dtype=torch.float64) - 20
    expected = _direct(hidden, weight, batch, reference, options)
    expected.backward()
    want_hidden, want_weight = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    lm_head = torch.nn.Linear(dim, vocab, bias=False, dtype=torch.float64)
    with torch.no_grad():
        lm_head.weight.copy_(weight)
    loss_fn = PreferenceLoss.Config(options=options, chunk_tokens=16, fixed_shapes=fixed_shapes).build()
    loss_fn.set_lm_head(lm_head)  # several chunks
    loss_fn.reference = ReferenceLogps(reference, torch.ones(records, dtype=torch.bool))
    markers = torch.zeros(rows, length, dtype=torch.int64)
    loss_fn.expect(markers, batch)
    pairs = torch.tensor(records)  # what torchtitan's count of the rows' markers gives
    loss, _ = loss_fn(hidden, markers, pairs)
    loss.backward()
    # float64 throughout (the two differ by the order of sums over a few hundred terms), but the loss torchtitan
    # logs is returned in float32: half a float32 ulp of it.
    assert abs(float(loss) - float(expected)) <= 2**-24 * abs(float(expected)) + 1e-12
    # torchtitan's chunked loss accumulates the hidden states' gradient in float32: one rounding of each.
    torch.testing.assert_close(hidden.grad, want_hidden, rtol=2**-24 * 1.01, atol=1e-12)
    torch.testing.assert_close(lm_head.weight.grad, want_weight, rtol=1e-9, atol=1e-12)
    metrics = loss_fn.step_metrics()
    assert metrics["loss"] == pytest.approx(float(expected), rel=1e-9)


def _traced_step(fixed_shapes: bool, pairs_per_row: int, seed: int):
    """The loss's forward and backward on a batch of 2 rows of 64 tokens, as its ops and their shapes."""
    generator = torch.Generator().manual_seed(seed)
    vocab, dim, rows, length = 50, 8, 2, 64
    batch, records = _batch(generator, vocab, rows, length, pairs_per_row=pairs_per_row)
    lm_head = torch.nn.Linear(dim, vocab, bias=False)
    loss_fn = PreferenceLoss.Config(chunk_tokens=16, fixed_shapes=fixed_shapes).build()
    loss_fn.set_lm_head(lm_head)
    # The records of a whole dataset, of which the batch holds some.
    loss_fn.reference = ReferenceLogps(
        torch.zeros(16, 2, dtype=torch.float64), torch.ones(16, dtype=torch.bool)
    )
    hidden = torch.randn(rows, length, dim, requires_grad=True, generator=generator)
    markers = torch.zeros(rows, length, dtype=torch.int64)
    loss_fn.expect(markers, batch)
    with compat.recorded_ops() as traced:
        loss, _ = loss_fn(hidden, markers, torch.tensor(records))
        loss.backward()
    return traced.ops


def test_fixed_shapes_run_the_same_ops_on_the_same_shapes_whatever_the_pairs():
    """The CPU twin of what Neuron needs (one compiled graph per input shape): with fixed shapes, two batches of
    the same rows and other pairs (1 and 3 to a row, other lengths) run the same aten ops on the same shapes,
    and none reads a value back to the host (``aten._local_scalar_dense``: ``.item()``, ``bool()``, ``int()``).
    The probe tells them apart without fixed shapes."""
    fixed = [_traced_step(True, pairs_per_row=p, seed=s) for p, s in ((1, 3), (3, 4))]
    assert fixed[0] == fixed[1]
    assert not [op for op, _ in fixed[0] if "_local_scalar_dense" in op]
    per_batch = [_traced_step(False, pairs_per_row=p, seed=s) for p, s in ((1, 3), (3, 4))]
    assert per_batch[0] != per_batch[1]
    assert [op for op, _ in per_batch[0] if "_local_scalar_dense" in op]


def test_policy_at_the_reference_gives_ln2():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(2)
    vocab, dim, rows, length = 40, 8, 2, 40
    batch, records = _batch(generator, vocab, rows, length, pairs_per_row=2)
    lm_head = torch.nn.Linear(dim, vocab, bias=False)
    hidden = torch.randn(rows, length, dim, requires_grad=True)
    loss_fn = PreferenceLoss.Config().build()
    loss_fn.set_lm_head(lm_head)
    # The reference is the policy itself: every pair's h is 0, whatever the fp32 rounding of its sums.
    layout, policy, _ = loss_fn.pair_logps(hidden, batch)
    table = torch.zeros(records, 2, dtype=torch.float64)
    table[layout.records_P] = policy
    loss_fn.reference = ReferenceLogps(table, torch.ones(records, dtype=torch.bool))
    markers = torch.zeros(rows, length, dtype=torch.int64)
    loss_fn.expect(markers, batch)
    loss, _ = loss_fn(hidden, markers, torch.tensor(records))
    assert abs(float(loss) - math.log(2)) <= 1e-6  # ln 2 rounded to fp32
    assert loss_fn.step_metrics()["accuracy"] == 0.0


@pytest.mark.parametrize(
    ("options", "flag"),
    [
        ({"beta": 0.0}, "--dpo.beta 0.0"),
        ({"beta": float("nan")}, "--dpo.beta nan"),
        ({"label_smoothing": 0.5}, "--dpo.label_smoothing 0.5"),
        ({"loss_type": "ipo", "label_smoothing": 0.1}, "--dpo.label_smoothing 0.1"),
        ({"sft_weight": -1.0}, "--dpo.sft_weight -1.0"),
    ],
)
def test_values_no_one_can_mean_are_refused(options, flag):
    with pytest.raises(UserInputError, match=flag.replace(".", r"\.")):
        PreferenceOptions(**options)


def test_parquet_message_pairs_and_identical_pairs(tmp_path, tokens):
    """Parquet holds message lists as lists of structs (every key in every message, null where absent); an
    implicit-prompt file has no 'prompt' column. Identical completions are kept and counted."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    user = {"role": "user", "content": "Name a colour."}
    records = [
        {"chosen": [user, {"role": "assistant", "content": "Blue."}],
         "rejected": [user, {"role": "assistant", "content": "Seven."}]},
        {"chosen": [user, {"role": "assistant", "content": "Red."}],
         "rejected": [user, {"role": "assistant", "content": "Red."}]},
    ]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "pairs.parquet")
    loader = TextChatDataLoader.Config(
        dataset=str(tmp_path / "pairs.parquet"), shuffle=False, infinite=False
    ).build(dp_world_size=1, dp_rank=0, tokenizer=tokens.base, seq_len=SEQ_LEN, local_batch_size=1)
    (inputs, markers), *_ = list(loader)
    layout = PairLayout.of(inputs["dpo_targets"], inputs["positions"], inputs["dpo_records"])
    assert layout.pairs == 2 and int((markers != IGNORE_INDEX).sum()) == 2
    assert loader.dataset.identical_pairs == 1


@pytest.mark.parametrize("share_prompt", [False, True])
def test_a_pairs_length_is_what_its_document_takes(tokens, share_prompt):
    """The length checked against the row is the document's (a message pair's sequences get an EOS appended)."""
    sharing = PreferenceTokenizer(tokens, ChatTokenizer(tokens), share_prompt)
    prompt = [{"role": "user", "content": "Name a colour, please."}]
    for record in (
        {"prompt": prompt, "chosen": [{"role": "assistant", "content": "Blue."}],
         "rejected": [{"role": "assistant", "content": "Seven."}]},
        {"prompt": "What is 2+2?", "chosen": " 4", "rejected": " 5"},
    ):  # fmt: skip
        pair = sharing.pair(record, SEQ_LEN)
        length = sum(pair.lengths(tokens.eos_id, share_prompt))
        assert len(pair.document(tokens.eos_id, 0, share_prompt)) == length
        sharing.pair(record, length)  # fits exactly
        with pytest.raises(InvalidRecord, match="longer than a row"):
            sharing.pair(record, length - 1)


def test_a_tool_call_turn_with_null_content_is_one_line(pairs):
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"function": {"name": "f", "arguments": {}}}],
    }
    record = {"prompt": [{"role": "user", "content": "Q"}], "chosen": [call], "rejected": [call]}
    try:
        pairs.pair(record, SEQ_LEN)
    except InvalidRecord as err:
        assert "\n" not in str(err)  # the embedded template writes no tool calls: refused in one line


def test_a_record_the_reference_pass_did_not_see_is_refused():
    reference = ReferenceLogps(torch.zeros(3, 2, dtype=torch.float64), torch.tensor([True, False, True]))
    assert reference.lookup(torch.tensor([0, 2])).shape == (2, 2)
    with pytest.raises(UserInputError, match=r"records \[1\] of the data have no reference"):
        reference.lookup(torch.tensor([0, 1]))


def test_rows_of_padding_only_train_nothing_and_still_project():
    """The end of a finite run: a batch without pairs gives loss 0 and zero gradients, through the output
    projection's chunked pass like any other batch."""
    lm_head = torch.nn.Linear(8, 20, bias=False)
    hidden = torch.randn(1, 16, 8, requires_grad=True)
    batch = PreferenceBatch(
        torch.full((1, 16), IGNORE_INDEX), torch.full((1, 16), -1), torch.arange(16)[None]
    )
    loss_fn = PreferenceLoss.Config().build()
    loss_fn.set_lm_head(lm_head)
    loss_fn.reference = ReferenceLogps(
        torch.zeros(0, 2, dtype=torch.float64), torch.zeros(0, dtype=torch.bool)
    )
    markers = torch.full((1, 16), IGNORE_INDEX)
    loss_fn.expect(markers, batch)
    loss, _ = loss_fn(hidden, markers, torch.tensor(4))
    loss.backward()
    assert float(loss) == 0.0 and not hidden.grad.any()
    assert lm_head.weight.grad is not None and not lm_head.weight.grad.any()


def test_the_reference_file_is_read_back_only_for_the_same_data(tmp_path):
    path = tmp_path / "reference_logps.safetensors"
    table = torch.tensor([[-3.0, -4.0], [-5.0, -6.0]], dtype=torch.float64)
    written = {"dataset": "pairs.jsonl", "records": "2", "seq_len": "256"}
    ReferenceLogps(table, torch.tensor([True, True])).save(path, written)
    assert not list(tmp_path.glob(".*partial"))  # written whole, then renamed
    read = ReferenceLogps.load(path, written)
    assert torch.equal(read.table_R2, table) and read.pairs == 2
    with pytest.raises(
        UserInputError, match=r"computed for other data \(seq_len '256' \(this run: '512'\)\)"
    ):
        ReferenceLogps.load(path, {**written, "seq_len": "512"})


def test_the_live_reference_swaps_the_starting_weights_in_and_back():
    """``--dpo.reference live``: the starting values of the trained weights (the frozen ones are not copied)
    are in the model only inside ``swapped_in``; a step checkpoint's values replace them on resume."""
    from qwen3_titan_common.train.preference import LiveReference

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    model[1].weight.requires_grad_(False)
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    live = LiveReference([model])
    assert set(live.frozen) == {"0.weight", "0.bias", "1.bias"}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    moved = {name: p.detach().clone() for name, p in model.named_parameters()}
    live.freeze_starting_weights()  # as at a run's start: the weights as they are now
    with torch.no_grad():
        model[0].weight.add_(1.0)
    with live.swapped_in():
        assert torch.equal(model[0].weight, moved["0.weight"])
        assert torch.equal(model[1].weight, moved["1.weight"])  # frozen: never swapped
    assert torch.equal(model[0].weight, moved["0.weight"] + 1.0)
    live.load_state_dict({name: start[name] for name in live.frozen})  # a resume's checkpoint
    with live.swapped_in():
        assert torch.equal(model[0].bias, start["0.bias"])
    assert live.nbytes == 4 * (6 + 2 + 2)


def test_the_live_reference_is_what_an_fsdp_forward_computes_with(tmp_path):
    """FSDP2 computes with an all-gathered copy of each group's shards, which the root group (and, under
    pipeline parallelism, every group) keeps after its forward: the swap reshards first, so that the reference's
    forward gathers the reference and the policy's next forward the policy, not the copy left by the other."""
    import torch.distributed as dist
    from qwen3_titan_common.train.preference import LiveReference
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        mesh = init_device_mesh("cpu", (1,))
        fully_shard(model[0], mesh=mesh)  # resharded after its forward
        fully_shard(model, mesh=mesh)  # the root: model[1] stays gathered after the forward
        live = LiveReference([model])
        live.freeze_starting_weights()
        x = torch.ones(2, 4)

        def computed_by(values):
            hidden = F.linear(x, values["0.weight"], values["0.bias"])
            return F.linear(hidden, values["1.weight"], values["1.bias"])

        start = {name: p.full_tensor().detach().clone() for name, p in live.weights.items()}
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        moved = {name: p.full_tensor().detach().clone() for name, p in live.weights.items()}
        with torch.no_grad():
            model(x)  # a forward of the policy (validation's), leaving the root gathered
            with live.swapped_in():
                reference = model(x)
            policy = model(x)
        torch.testing.assert_close(reference, computed_by(start), rtol=0, atol=0)
        torch.testing.assert_close(policy, computed_by(moved), rtol=0, atol=0)
    finally:
        dist.destroy_process_group()
