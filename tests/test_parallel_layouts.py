"""Every parallel layout trains what one rank trains on the same global batch (CPU, gloo, fp32, real `train`).

Each layout runs 4 steps of global batch 8 beside one rank with batch 8, from the same seed (the same random
weights in every layout: models.layout_init) and the same rows (one packed stream dealt to the ranks:
data.dataset); step k's loss agrees within the derived bound of 2k - 1 forward passes of the model
(train.tolerance). A checkpoint of one rank count resumes on another and continues the same losses.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from qwen3_titan_common.train.tolerance import ModelBounds
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint
from qwen3_titan_testing.narrow_moe import tensorboard_scalars
from safetensors.torch import load_file

TRAIN = str(Path(sys.executable).with_name("train"))
STEPS, SEQ_LEN, GLOBAL_BATCH = 4, 128, 8
TOKENS = SEQ_LEN * GLOBAL_BATCH
RUN = [
    "--steps", str(STEPS), "--seq-len", str(SEQ_LEN), "--training.mixed_precision_param", "float32",
    "--debug.seed", "0", "--validator.no-enable", "--metrics.log_freq", "1",
]  # fmt: skip
NO_OUTPUTS = ["--checkpoint.no-enable", "--hf.no-export"]
LOSS = "loss_metrics/global_avg_loss"


def _train(backend: str, out: Path, nproc: int, *flags: str) -> dict[str, list[float]]:
    env = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": backend, "OMP_NUM_THREADS": "1"}
    command = [TRAIN, "--nproc", str(nproc), *RUN, *flags, "--out", str(out)]
    proc = subprocess.run(command, cwd=out.parent, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:] + _full_log_tail(log)
    assert "internal error" not in log
    return tensorboard_scalars(out / "tb")


def _full_log_tail(said: str) -> str:
    """The end of the run's full log (the ranks' stderr too), where a failed run's last line names it."""
    if "the full log is in " not in said:
        return ""
    path = Path(said.split("the full log is in ")[-1].split(" (")[0].strip())
    return "\n--- the full log's end:\n" + path.read_text(errors="replace")[-6000:] if path.is_file() else ""


def _assert_same_losses(
    reference: list[float], other: list[float], bounds: ModelBounds, steps=range(1, STEPS + 1)
):
    assert len(other) == len(list(steps)), other
    for step, loss in zip(steps, other, strict=True):
        expected = reference[step - 1]
        bound = bounds.loss_atol(expected, tokens=TOKENS, seq_len=SEQ_LEN, passes=2 * step - 1)
        assert abs(loss - expected) <= bound, (step, reference, other, bound)


# -- dense: FSDP, micro-batches, TP; resume on another rank count --------------------------------------


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """One rank, batch 8, checkpoints at steps 2 and 4, exported: the reference of every dense layout."""
    out = tmp_path_factory.mktemp("dense") / "one-rank"
    scalars = _train("native-backend", out, 1, "--checkpoint.interval", "2")
    return out, scalars[LOSS], ModelBounds.from_dir(out / "hf" / f"step-{STEPS}")


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, flags",
    # Tensor parallelism: test_multi_rank_cpu.py, from a model of another vocabulary than the config's.
    [(1, ["--batch-size", "4", "--training.global_batch_size", "8"])],
    ids=["2-micro-batches"],
)
def test_dense_layouts_train_what_one_rank_trains(dense, tmp_path, nproc, flags):
    _, reference, bounds = dense
    losses = _train("native-backend", tmp_path / "run", nproc, *flags, *NO_OUTPUTS)[LOSS]
    _assert_same_losses(reference, losses, bounds)


@pytest.mark.slow
def test_fsdp_on_two_ranks_trains_what_one_rank_trains(dense, tmp_path):
    # A checkpoint of 2 FSDP ranks read by one: test_context_parallel_checkpoint_resumes_on_one_rank (the CP
    # ranks shard the weights as FSDP ranks do).
    _, reference, bounds = dense
    losses = _train("native-backend", tmp_path / "run", 2, "--batch-size", "4", *NO_OUTPUTS)[LOSS]
    _assert_same_losses(reference, losses, bounds)


def _resume(source: Path, tmp_path: Path, nproc: int, *flags: str, backend="native-backend") -> list[float]:
    """The run of ``source`` resumed from its step-2 checkpoint (step 4's removed) on ``nproc`` ranks."""
    out = tmp_path / "resumed"
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("tb", "hf", "logs", f"step-{STEPS}"))
    return _train(backend, out, nproc, "--checkpoint.interval", "2", "--hf.no-export", *flags)[LOSS]


@pytest.mark.slow
def test_one_rank_checkpoint_resumes_on_two(dense, tmp_path):
    source, reference, bounds = dense
    losses = _resume(source, tmp_path, 2, "--batch-size", "4")
    _assert_same_losses(reference, losses, bounds, steps=range(3, STEPS + 1))


# -- context parallel: each row's tokens over the CP ranks, its documents across their chunks ------------------

CP = "--parallelism.context_parallel_degree"


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, flags",
    [
        (4, [CP, "4"]),
        (4, [CP, "2", "--batch-size", "4"]),
        (4, [CP, "2", "--parallelism.tensor_parallel_degree", "2"]),
    ],
    ids=["cp-4", "cp-2-fsdp-2", "cp-2-tp-2"],
)
def test_context_parallel_layouts_train_what_one_rank_trains(dense, tmp_path, nproc, flags):
    _, reference, bounds = dense
    losses = _train("native-backend", tmp_path / "run", nproc, *flags, *NO_OUTPUTS)[LOSS]
    _assert_same_losses(reference, losses, bounds)


@pytest.mark.slow
def test_context_parallel_checkpoint_resumes_on_one_rank(dense, tmp_path):
    # CP 2 trains what one rank trains; its checkpoint (FSDP shards over the CP ranks) read by one rank, which
    # takes the same global batch in 4 micro-batches of 2, continues the same losses.
    _, reference, bounds = dense
    source = tmp_path / "cp"
    trained = _train("native-backend", source, 2, CP, "2", "--checkpoint.interval", "2", "--hf.no-export")
    _assert_same_losses(reference, trained[LOSS], bounds)
    losses = _resume(source, tmp_path, 1, "--batch-size", "2", "--training.global_batch_size", "8")
    _assert_same_losses(reference, losses, bounds, steps=range(3, STEPS + 1))


# -- hf-v5: transformers' model in FSDP, CP and TP layouts ------------------------------------------------

HF_V5, TP = "hf-v5-backend", "--parallelism.tensor_parallel_degree"


@pytest.fixture(scope="module")
def hf_v5(tmp_path_factory):
    """One rank of the transformers model (its own initialisation rule, drawn whole per tensor too), batch 8,
    exported: the reference of hf-v5's layouts."""
    out = tmp_path_factory.mktemp("hf-v5") / "one-rank"
    scalars = _train(HF_V5, out, 1, "--checkpoint.no-enable")
    return scalars[LOSS], ModelBounds.from_dir(out / "hf" / f"step-{STEPS}")


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, flags",
    [(2, ["--batch-size", "4"]), (4, [TP, "2", CP, "2"])],
    ids=["fsdp-2", "tp-2-cp-2"],
)
def test_hf_v5_layouts_train_what_one_rank_trains(hf_v5, tmp_path, nproc, flags):
    # FSDP2's reductions on gloo; context parallelism over the block-sparse attention (the keys and values
    # gathered in its attention function) beside tensor parallelism with sequence parallelism (each CP rank's
    # share of the rows split again along the sequence between the TP ranks' norms).
    reference, bounds = hf_v5
    _assert_same_losses(reference, _train(HF_V5, tmp_path / "run", nproc, *flags, *NO_OUTPUTS)[LOSS], bounds)


@pytest.mark.slow
def test_hf_v5_tensor_parallel_trains_what_one_rank_trains_and_resumes_on_one_rank(hf_v5, tmp_path):
    # Tensor parallelism in torch's plan styles, sequence parallel, the tied embedding and lm_head one DTensor,
    # under FSDP2 over the other 2 ranks; its checkpoint (TP x FSDP shards) read by one rank.
    reference, bounds = hf_v5
    source = tmp_path / "tp"
    flags = [TP, "2", "--batch-size", "4", "--checkpoint.interval", "2", "--hf.no-export"]
    trained = _train(HF_V5, source, 4, *flags)
    _assert_same_losses(reference, trained[LOSS], bounds)
    losses = _resume(source, tmp_path, 1, backend=HF_V5)
    _assert_same_losses(reference, losses, bounds, steps=range(3, STEPS + 1))


def _initial_weights_exported(export: Path) -> None:
    """``export`` (of a run at learning rate 0 from the seed) holds the initial weights every layout draws whole
    per tensor (``models.layout_init``), bit for bit: each shard in its place, a tied embedding once."""
    from qwen3_titan_common.hf.model_dir import open_model_dir
    from qwen3_titan_common.hf.titan_load import read_hf_state_dict
    from qwen3_titan_common.models.layout_init import initialise_whole_then_shard
    from qwen3_titan_hf_v5.model import HFCausalLM
    from qwen3_titan_hf_v5.state_dict_adapter import HFv5StateDictAdapter

    exported = read_hf_state_dict(open_model_dir(export))
    config = HFCausalLM.Config(hf_config=json.loads((export / "config.json").read_text()))
    one_rank = config.build()
    initialise_whole_then_shard([one_rank], seed=0)
    # The model's own names to the checkpoint's (per-expert tensors on disk), as its export writes them.
    expected = HFv5StateDictAdapter(config, None).to_hf(one_rank.state_dict())
    assert set(exported) == set(expected)
    different = [key for key in exported if not exported[key].equal(expected[key])]
    assert not different, different


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, flags",
    [
        (2, [TP, "2"]),
        (2, ["--config", "debug_moe", "--parallelism.expert_parallel_degree", "2", "--batch-size", "4"]),
    ],
    ids=["tp-2", "ep-2"],
)  # fmt: skip
def test_hf_v5_layouts_export_the_weights_of_one_rank(tmp_path, nproc, flags):
    # Learning rate 0: the export is the initial weights, gathered from TP 2 shards, or from the experts
    # of 2 expert-parallel ranks (their forward and backward through the exchange of exactly the routed rows).
    out = tmp_path / "run"
    _train(HF_V5, out, nproc, *flags, "--lr", "0", "--steps", "1", "--checkpoint.no-enable")
    _initial_weights_exported(out / "hf" / "step-1")


@pytest.mark.slow
def test_hf_v5_expert_parallel_with_fsdp_trains_what_one_rank_trains(tmp_path):
    # transformers' Qwen3-MoE with its experts over 2 expert-parallel ranks (Neuron's fixed-capacity exchange, at a
    # capacity that drops nothing), every weight sharded by FSDP over 4 ranks; the balance loss on the global batch.
    one = _train(HF_V5, tmp_path / "one", 1, *MOE, "--checkpoint.no-enable")
    bounds = ModelBounds.from_dir(tmp_path / "one" / "hf" / f"step-{STEPS}")
    ep = [
        "--parallelism.expert_parallel_degree",
        "2",
        "--batch-size",
        "2",
        "--moe.capacity_factor",
        _no_drop_capacity(),
    ]
    four = _train(HF_V5, tmp_path / "ep", 4, *MOE, *ep, *NO_OUTPUTS)
    _assert_same_losses(one[LOSS], four[LOSS], bounds)
    assert four["moe/dropped_share"] == [0.0] * STEPS


# -- pipeline parallel (untied), expert parallel (MoE) --------------------------------------------------


@pytest.mark.slow
def test_pipeline_parallel_trains_and_exports_what_one_rank_does(tmp_path):
    # Both backends' stages against the native backend's one rank from the same checkpoint: the two backends
    # train one model to the same losses within this bound (test_backend_parity.py). hf-v5 splits transformers'
    # decoder itself (its stages keep the checkpoint's names).
    model = make_tiny_checkpoint(tmp_path / "untied", tied=False)
    bounds = ModelBounds.from_dir(model)
    from_model = ["--hf-model", str(model), "--checkpoint.no-enable"]
    one = _train("native-backend", tmp_path / "one", 1, *from_model)
    exported_one = load_file(next((tmp_path / "one" / "hf" / f"step-{STEPS}").glob("*.safetensors")))
    # hf-v5 with tensor parallelism too (without sequence parallelism: the residual stream replicated over the TP
    # ranks), under DualPipeV: 4 stages of the 2-layer model in a V, pipeline rank 0 holding the first (the
    # embedding and layer 0) and the last (the norm and lm_head only), forward and backward overlapped.
    looped = [
        TP, "2", "--parallelism.no-enable-sequence-parallel", "--parallelism.pipeline_parallel_schedule", "DualPipeV",
    ]  # fmt: skip
    # native with context parallelism beside the stages: each stage's layers take the CP rank's share of the rows.
    for backend, nproc, flags in (("native-backend", 4, [CP, "2"]), (HF_V5, 4, looped)):
        pp = tmp_path / backend
        staged = _train(
            backend, pp, nproc, *from_model, "--parallelism.pipeline_parallel_degree", "2", *flags
        )
        _assert_same_losses(one[LOSS], staged[LOSS], bounds)
        # Both stages' weights reach the export, under the names one rank writes.
        exported = load_file(next((pp / "hf" / f"step-{STEPS}").glob("*.safetensors")))
        assert exported.keys() == exported_one.keys(), backend


MOE = ["--config", "debug_moe", "--moe.router_aux_loss", "on", "--moe.router_aux_loss_scope", "global_batch"]


def _no_drop_capacity() -> str:
    """A capacity at which no rank ever drops a token: each expert can take every token (experts / top_k)."""
    from qwen3_titan_nki_moe.config_registry import debug_moe

    moe = debug_moe().architecture.moe
    return str(moe.num_experts / moe.num_experts_per_tok)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe") / "one-rank"
    scalars = _train("nki-moe-backend", out, 1, *MOE, "--checkpoint.no-enable")
    return scalars, ModelBounds.from_dir(out / "hf" / f"step-{STEPS}")


@pytest.mark.slow
def test_expert_parallel_with_fsdp_trains_what_one_rank_trains(moe, tmp_path):
    # 4 ranks: the experts over 2 expert-parallel ranks, every weight sharded by FSDP over 4 (dp_shard 4).
    reference, bounds = moe
    # Default flags: on the CPU the exchange sends exactly the routed rows, so it has no capacity and no
    # dropped share to report.
    ep = ["--parallelism.expert_parallel_degree", "2"]
    scalars = _train("nki-moe-backend", tmp_path / "ep", 4, *MOE, *ep, "--batch-size", "2", *NO_OUTPUTS)
    _assert_same_losses(reference[LOSS], scalars[LOSS], bounds)
    assert "moe/dropped_share" not in scalars


@pytest.mark.slow
def test_expert_parallel_with_context_parallel_trains_what_one_rank_trains(tmp_path):
    # 4 ranks: rows over 2 CP ranks, the experts over 2 expert-parallel ranks, 2 data-parallel rows of batch 4.
    # Without the router balance loss, which runs with data and expert parallelism only.
    one = _train("nki-moe-backend", tmp_path / "one", 1, "--config", "debug_moe", "--checkpoint.no-enable")
    layout = [CP, "2", "--parallelism.expert_parallel_degree", "2"]
    four = _train("nki-moe-backend", tmp_path / "cp-ep", 4, "--config", "debug_moe", *layout, "--batch-size", "4",
                  *NO_OUTPUTS)  # fmt: skip
    _assert_same_losses(
        one[LOSS], four[LOSS], ModelBounds.from_dir(tmp_path / "one" / "hf" / f"step-{STEPS}")
    )
    assert "moe/dropped_share" not in four


@pytest.mark.slow
def test_expert_parallel_computes_and_exports_what_one_rank_does(tmp_path):
    # Learning rate 0: every step's loss is the same initial weights' on that step's rows (the forward of both
    # expert ranks and their exchange), and the export is those weights, drawn whole per
    # tensor from the seed: every expert of both ranks must reach it in its place, bit for bit. Both exchanges:
    # the default one of exactly the routed rows, and the fixed-capacity one (Neuron's) at a capacity that
    # drops nothing.
    fixed = [*MOE, "--lr", "0", "--checkpoint.no-enable"]
    one = _train("nki-moe-backend", tmp_path / "one", 1, *fixed)
    ep = ["--batch-size", "4", "--parallelism.expert_parallel_degree", "2"]
    exact = _train("nki-moe-backend", tmp_path / "exact", 2, *fixed, *ep)
    capacity = _train(
        "nki-moe-backend", tmp_path / "capacity", 2, *fixed, *ep, "--moe.capacity_factor", _no_drop_capacity()
    )
    assert capacity["moe/dropped_share"] == [0.0] * STEPS
    bounds = ModelBounds.from_dir(tmp_path / "one" / "hf" / f"step-{STEPS}")
    exported_one = load_file(next((tmp_path / "one" / "hf" / f"step-{STEPS}").glob("*.safetensors")))
    for name, two in (("exact", exact), ("capacity", capacity)):
        for step, (a, b) in enumerate(zip(one[LOSS], two[LOSS], strict=True), start=1):
            # Unchanged weights: each step's loss is one forward pass apart, whatever the step.
            assert abs(a - b) <= bounds.loss_atol(a, tokens=TOKENS, seq_len=SEQ_LEN, passes=1), (
                name,
                step,
                one[LOSS],
                two[LOSS],
            )
        exported_ep = load_file(next((tmp_path / name / "hf" / f"step-{STEPS}").glob("*.safetensors")))
        assert exported_one.keys() == exported_ep.keys()
        different = [key for key in exported_one if not exported_one[key].equal(exported_ep[key])]
        assert not different, (name, different)


# -- the check users run before a long job ----------------------------------------------------------------


@pytest.mark.slow
def test_check_layout_runs_the_layout_beside_one_rank_in_one_line(tmp_path):
    # Context parallelism here; FSDP in the next test, on the job's own flags.
    flags, layout, batch = [CP, "2", "--batch-size", "4"], "dp_replicate 1 x dp_shard(FSDP) 1 x context 2", 4
    env = {
        **os.environ,
        "QWEN3_TITAN_DEVICE": "cpu",
        "QWEN3_TITAN_BACKEND": "native-backend",
        "OMP_NUM_THREADS": "1",
    }
    command = [TRAIN, "--check-layout", "--nproc", "2", *flags, "--seq-len", str(SEQ_LEN)]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("[check] ")]
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert lines[-1].startswith(f"[check] 2 ranks = {layout}") and lines[-1].endswith(": ok")
    assert f"2 of the model's 4 layers, 3 steps, global batch {batch} x 128" in lines[-1]
    assert (
        list(tmp_path.iterdir()) == []
    )  # nothing written where it ran (its runs went to a temporary folder)


@pytest.mark.slow
def test_check_layout_takes_the_jobs_own_flags_and_writes_none_of_its_folders(tmp_path_factory):
    # The job's export, checkpoint and logging flags are accepted and change nothing; its folders (--out,
    # --hf.export_dir) get nothing; a model shallower than the check's 2 layers is checked at its own depth. A
    # LoRA job: its one rank exports an adapter, and the bound is read from the model it adapts.
    model = make_tiny_checkpoint(
        tmp_path_factory.mktemp("shallow") / "m", config_changes={"num_hidden_layers": 1}
    )
    here = tmp_path_factory.mktemp("job")
    env = {
        **os.environ,
        "QWEN3_TITAN_DEVICE": "cpu",
        "QWEN3_TITAN_BACKEND": "native-backend",
        "OMP_NUM_THREADS": "1",
    }
    command = [
        TRAIN, "--check-layout", "--hf-model", str(model), "--nproc", "2", "--batch-size", "4", "--seq-len", "64",
        "--hf.no-export", "--hf.export_dir", "exports", "--checkpoint.interval", "5", "--metrics.log_freq", "2",
        "--lora.rank", "4", "--out", "job",
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=here, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    last = [line for line in proc.stdout.splitlines() if line.startswith("[check] ")][-1]
    assert last.startswith("[check] 2 ranks = dp_replicate 1 x dp_shard(FSDP) 2 x context 1"), last
    assert "(1 of the model's 1 layers, 3 steps, global batch 8 x 64)" in last and last.endswith(": ok"), last
    assert (
        "[check] the layout's 2 ranks all run on this machine, one process each, beside 1 rank" in proc.stdout
    )
    assert list(here.iterdir()) == []
