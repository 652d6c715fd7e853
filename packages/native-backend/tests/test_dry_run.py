import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TRAIN = str(Path(sys.executable).with_name("train"))


def _dry_run(*args):
    env = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": "native-backend"}
    return subprocess.run([TRAIN, "--dry-run", *args], env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_tensor_with_context_parallelism_is_estimated():
    # Context parallelism puts tensor parallelism on torchtitan's partial_dtensor path, whose logits are a DTensor
    # sharded along the vocabulary (was: internal error in the launcher, nll_loss on mixed tensors).
    proc = _dry_run(
        "--nproc", "8", "--parallelism.tensor_parallel_degree", "2", "--parallelism.context_parallel_degree", "2",
        "--memory-per-rank", "h100",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "8 ranks = dp_replicate 1 x dp_shard(FSDP) 2 x context 2 x tensor 2" in proc.stdout
    assert "[dry-run] memory fits:" in proc.stdout


def test_degrees_that_do_not_multiply_fail_with_one_line():
    proc = _dry_run(
        "--nproc", "64", "--config", "native_qwen3_4b", "--parallelism.data_parallel_shard_degree", "8"
    )
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("train: parallel degrees do not multiply to the rank count")
    assert "dp_shard 8" in last and "expected 64 ranks" in last


def _estimate(stdout: str) -> dict[str, float]:
    kinds = re.search(r"GiB: (.*?) \+ process", stdout)
    assert kinds, stdout[-2000:]
    return {
        name: float(value) for name, value in (part.rsplit(" ", 1) for part in kinds.group(1).split(", "))
    }


def test_the_estimate_follows_activation_checkpointing_given_as_torchtitans_subcommand():
    # The subcommand is the last argument (tyro applies what follows it to it); the dry run's own flags go before.
    plain = _dry_run("--batch-size", "32", "--seq-len", "512")
    full = _dry_run("--batch-size", "32", "--seq-len", "512", "activation-checkpoint:full")
    assert plain.returncode == 0 and full.returncode == 0, full.stderr[-2000:]
    plain_kinds, full_kinds = _estimate(plain.stdout), _estimate(full.stdout)
    # Same weights; recomputed layers keep only their inputs (the logits and loss are not recomputed).
    assert plain_kinds["params"] == full_kinds["params"]
    assert full_kinds["activations"] < plain_kinds["activations"]


def _total(stdout: str) -> float:
    found = re.search(r"total ~([0-9.]+) GiB", stdout)
    assert found, stdout[-2000:]
    return float(found.group(1))


@pytest.mark.slow
def test_a_long_row_of_a_large_model_is_shown_more_nodes_and_recomputation_together(tmp_path):
    """Neither alone fits: a 65,536-token row of the 4B recipe on one H100 needs its activations recomputed and
    its state sharded over more nodes; the advice names both, and its figure is the job's with both applied."""
    job = ["--nproc", "1", "--config", "native_qwen3_4b", "--seq-len", "65536", "--batch-size", "1",
           "--memory-per-rank", "h100", "--out", str(tmp_path / "dry")]  # fmt: skip
    refused = _dry_run(*job)
    assert refused.returncode == 2, refused.stderr[-2000:]
    advice = re.search(
        r"fits by the same estimate: --nnodes (\d+) with activation-checkpoint:full as the last argument "
        r"\(\d+ ranks, .*; ~([0-9.]+) GiB per rank\)",
        refused.stderr,
    )
    assert advice, refused.stderr[-2000:]
    nodes, figure = advice.group(1), float(advice.group(2))
    applied = _dry_run(*job, "--nnodes", nodes, "activation-checkpoint:full")
    assert applied.returncode == 0, applied.stderr[-2000:]
    assert _total(applied.stdout) == figure


@pytest.mark.slow
def test_a_run_that_names_no_batch_gets_the_largest_that_fits_the_stated_memory(tmp_path):
    one, eight = (_dry_run("--batch-size", str(b), "--out", str(tmp_path / "dry")) for b in (1, 8))
    assert one.returncode == 0 and eight.returncode == 0, eight.stderr[-2000:]
    # Between the estimates of 1 and 8 rows (the debug config's batch): 8 does not fit, a smaller batch does.
    memory = round((_total(one.stdout) + _total(eight.stdout)) / 2, 3)
    env = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": "native-backend"}
    run = subprocess.run(
        [TRAIN, "--memory-per-rank", str(memory), "--steps", "1", "--out", str(tmp_path / "out"),
         "--checkpoint.no-enable", "--hf.no-export", "--validator.no-enable"],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    said = re.search(
        r"\[train\] memory: batch (\d+) per rank \(the config's 8 does not fit\), ~([0-9.]+) GiB", run.stderr
    )
    assert said, run.stderr[-3000:]
    batch, estimate = int(said.group(1)), float(said.group(2))
    assert 1 <= batch < 8 and estimate <= memory
    # Stated before torchrun starts, and what the ranks train.
    assert run.stderr.index("[train] memory:") < run.stderr.index("torchrun")
    assert f"local batch size {batch}," in run.stdout + run.stderr


def test_a_job_whose_weights_do_not_fit_is_shown_the_fewest_nodes_that_do(tmp_path):
    """More FSDP ranks, checked by the same estimate: the debug job planned for a GPU whose memory holds its
    activations and under a third of its weights, gradients and optimizer state."""
    from qwen3_titan_common.launcher.plan import LaunchPlan
    from qwen3_titan_common.perf.fit import RankMemory
    from qwen3_titan_common.train.memory_check import estimate_rank0, with_more_nodes
    from qwen3_titan_testing.fake_rank import as_fake_rank, checked_config

    plan = LaunchPlan(
        module="qwen3_titan_native", config="debug", nproc_per_node=2, nnodes=1, node_rank=0,
        rdzv_endpoint="localhost:0",
        passthrough=[
            "--dump_folder", str(tmp_path), "--training.local_batch_size", "1", "--training.seq_len", "32",
        ],
    )  # fmt: skip
    with as_fake_rank(plan):
        config, _ = checked_config(plan)
        job, estimate = estimate_rank0(plan, config, "cuda")
        state = sum(estimate.by_kind[kind] for kind in ("params", "grads", "optimizer"))
        assert state > estimate.by_kind["activations"], estimate.describe()
        memory = RankMemory(estimate.total_bytes - state + int(state * 0.3), "a small GPU")
        assert estimate.total_bytes > memory.bytes_per_rank
        found = with_more_nodes(job, estimate, memory, plan.nnodes)
        assert found is not None
        nodes, ranks, tried = found
        # Each node keeps the job's 2 ranks; the fewest nodes whose ranks fit, by the tracker of the dry run.
        assert ranks == 2 * nodes and nodes in (4, 8, 16) and tried.total_bytes <= memory.bytes_per_rank
        assert tried.by_kind["params"] < estimate.by_kind["params"] * 2 / nodes
        fewer = job.on_ranks(ranks // 2).step_memory(
            batch=1, ac_config=config.activation_checkpoint, baseline_bytes=estimate.baseline_bytes
        )
        assert fewer.total_bytes > memory.bytes_per_rank


# Rank 0 of the debug config at 1 x 32 rows, in a process of its own (torch keeps device meshes across the fake
# process groups of one process): argv 1 the dump folder, 2 the job's ranks, the rest more flags; then a body
# that prints one JSON line.
_DEBUG_RANK0 = """
import json, sys
from qwen3_titan_common.launcher.plan import LaunchPlan
from qwen3_titan_common.perf.fit import RankMemory
from qwen3_titan_testing.fake_rank import as_fake_rank, checked_config
from qwen3_titan_common.train.memory_check import does_not_fit, estimate_rank0, fit_line

plan = LaunchPlan(
    module="qwen3_titan_native", config="debug", nproc_per_node=int(sys.argv[2]), nnodes=1, node_rank=0,
    rdzv_endpoint="localhost:0",
    passthrough=["--dump_folder", sys.argv[1], "--training.local_batch_size", "1", "--training.seq_len", "32",
                 *sys.argv[3:]],
)
"""


def _in_debug_rank0(body: str, folder, ranks: int, *flags: str):
    import json

    script = _DEBUG_RANK0 + body
    proc = subprocess.run(
        [sys.executable, "-c", script, str(folder), str(ranks), *flags],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_HALF_AND_WHOLE = """
with as_fake_rank(plan):
    config, _ = checked_config(plan)
    job, two = estimate_rank0(plan, config, "cpu")
    one = job.on_ranks(1).step_memory(
        batch=1, ac_config=config.activation_checkpoint, baseline_bytes=two.baseline_bytes
    )
print(json.dumps([one.by_kind, two.by_kind, one.describe(), two.describe()]))
"""


def test_two_cpu_ranks_hold_half_the_state_one_rank_holds_whole(tmp_path):
    """One CPU rank trains the model whole (no FSDP); two shard it. Each of the two holds half the weights and
    optimizer state of the one, up to FSDP's padding of each parameter to an even row count (at most one row of
    each parameter per rank), not the whole model materialised from its shards. Its gradients at the peak (its
    shards, and the unsharded gradients of the layers being reduced) are fewer than the one rank's."""
    one, two, *described = _in_debug_rank0(_HALF_AND_WHOLE, tmp_path, 2)
    assert one["params"] > 0
    for kind in ("params", "optimizer"):
        half = one[kind] / 2
        assert half <= two[kind] <= half * 1.02, (kind, described)
    assert 0 < two["grads"] < one["grads"], described


_LORA = """
with as_fake_rank(plan):
    config, _ = checked_config(plan)
    _, lora = estimate_rank0(plan, config, "cpu")
    trainable = sum(p.numel() for p in config.model_spec.model.build().parameters() if p.requires_grad)
print(json.dumps([lora.by_kind, trainable, lora.describe()]))
"""


def test_a_lora_run_on_one_rank_is_estimated_with_gradients_of_its_adapters_only(tmp_path):
    """One CPU rank trains the model whole, its base weights frozen: torch's tracker is told they take no gradient
    hook (it refuses one on a frozen tensor, which made every LoRA fit check an internal error). Gradients and
    AdamW's two moments are the adapters' alone, in fp32."""
    kinds, trainable, described = _in_debug_rank0(_LORA, tmp_path, 1, "--lora.rank", "4")
    assert kinds["params"] > 20 * 4 * trainable, described  # the frozen base is most of the weights
    assert kinds["grads"] <= 4 * trainable, described  # at most the adapters' (none alive at this peak)
    assert 2 * 4 * trainable <= kinds["optimizer"] <= 2 * 4 * trainable * 1.01, described


_NOTHING_FITS = """
with as_fake_rank(plan):
    config, _ = checked_config(plan)
    job, estimate = estimate_rank0(plan, config, "cpu")
    memory = RankMemory(estimate.baseline_bytes + 2**20, "the process and 1 MiB")
    _, line = fit_line(plan, estimate, memory)
    asked = []
    # Once per process: the advice tries other layouts, each on a fake process group of its own.
    said = does_not_fit(
        job, estimate, line, memory, 1, runs=lambda field: asked.append(field) or field == "tensor_parallel_degree"
    )
print(json.dumps([said, asked]))
"""


def test_a_job_that_fits_nowhere_is_told_only_the_ways_it_can_take(tmp_path):
    """Advice names a split of the model only where the job runs with it (the rehearsal asks the run's own
    checks: LoRA's, a tied model's stages, the backend's), else shorter rows."""
    said, asked = _in_debug_rank0(_NOTHING_FITS, tmp_path, 2)
    assert asked == ["tensor_parallel_degree", "pipeline_parallel_degree"]
    assert said.endswith(
        "fits by the same estimate: train LoRA adapters, or shard with tensor parallelism"
    ), said


_LONG_ROW = """
import json, sys
from qwen3_titan_testing.fake_rank import as_fake_rank, checked_config
from qwen3_titan_common.launcher.plan import LaunchPlan
from qwen3_titan_common.perf.fit import RankMemory
from qwen3_titan_common.train.memory_check import estimate_rank0, with_context_parallel

plan = LaunchPlan(
    module="qwen3_titan_native", config="debug", nproc_per_node=8, nnodes=1, node_rank=0,
    rdzv_endpoint="localhost:0",
    passthrough=["--dump_folder", sys.argv[1], "--training.local_batch_size", "1", "--training.seq_len", "2048"],
)
with as_fake_rank(plan):
    config, _ = checked_config(plan)
    job, estimate = estimate_rank0(plan, config, "cuda")
    arch = config.architecture
    memory = RankMemory(int(estimate.total_bytes * 0.7), "a small GPU")
    degree, tried = with_context_parallel(job, estimate, memory)
shape = [arch.num_key_value_heads, arch.head_dim, arch.num_hidden_layers]
print(json.dumps([degree, estimate.by_kind, tried.by_kind, memory.bytes_per_rank, shape]))
"""


def test_a_long_row_that_does_not_fit_is_shown_the_context_parallel_degree_that_does(tmp_path):
    """Context parallelism, checked by the same estimate (in a process of its own: each estimate lays a fake
    mesh out): each rank tracks its share of the row, and the whole row's gathered keys and values each layer
    keeps for its backward are added."""
    env = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", _LONG_ROW, str(tmp_path)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    degree, whole, split, memory, (kv_heads, head_dim, layers) = json.loads(
        proc.stdout.strip().splitlines()[-1]
    )
    assert degree in (2, 4, 8) and sum(split.values()) <= memory < sum(whole.values())
    # The rank's share of the activations, and more: every layer keeps the row's gathered keys and values.
    gathered = 2 * (2048 - 2048 // degree) * kv_heads * head_dim * 2 * layers
    assert split["activations"] >= whole["activations"] / degree + gathered * 0.99
    assert split["activations"] < whole["activations"]


@pytest.mark.slow
def test_a_batch_that_fits_only_recomputed_gets_full_activation_checkpointing(tmp_path):
    shape = ["--batch-size", "1", "--seq-len", "2048", "--out", str(tmp_path / "dry")]
    kept, recomputed = _dry_run(*shape), _dry_run(*shape, "activation-checkpoint:full")
    assert kept.returncode == 0 and recomputed.returncode == 0, kept.stderr[-2000:]
    assert _total(recomputed.stdout) < _total(kept.stdout) - 0.02
    memory = round((_total(kept.stdout) + _total(recomputed.stdout)) / 2, 3)
    env = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": "native-backend"}
    run = subprocess.run(
        [TRAIN, "--memory-per-rank", str(memory), *shape[:4], "--steps", "1", "--out", str(tmp_path / "out"),
         "--checkpoint.no-enable", "--hf.no-export", "--validator.no-enable"],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    said = re.search(
        r"\[train\] memory: activation-checkpoint:full \(the batch of 1 does not fit .*~([0-9.]+) GiB",
        run.stderr,
    )
    assert said and float(said.group(1)) <= memory, run.stderr[-3000:]
    # What the ranks run: torchrun's command carries the subcommand, last.
    assert re.search(r"--launcher.command '[^']*' activation-checkpoint:full\n", run.stderr), run.stderr[
        -3000:
    ]


_DEEP = """
import json, sys
import qwen3_titan_common.train.memory_check as memory_check
from qwen3_titan_testing.fake_rank import as_fake_rank, checked_config
from qwen3_titan_common.launcher.plan import LaunchPlan
from qwen3_titan_common.train.memory_check import estimate_rank0

plan = LaunchPlan(
    module="qwen3_titan_native", config="debug", nproc_per_node=2, nnodes=1, node_rank=0,
    rdzv_endpoint="localhost:0",
    passthrough=["--dump_folder", sys.argv[1], "--hf.model_dir", sys.argv[2], "--training.local_batch_size", "2",
                 "--training.seq_len", "256"],
)
with as_fake_rank(plan):
    config, _ = checked_config(plan)
    job, extrapolated = estimate_rank0(plan, config, "cpu")
    memory_check.EXTRAPOLATED_ABOVE = 10**6
    tracked = job.step_memory(batch=2, ac_config=config.activation_checkpoint, baseline_bytes=0)
print(json.dumps([extrapolated.by_kind, extrapolated.extrapolated_from, tracked.by_kind]))
"""


def test_a_deep_models_step_is_its_first_layers_extrapolated_per_layer(tmp_path):
    """A model deeper than 8 layers is tracked at its first 2 and 4 layers, and each kind extrapolated per layer
    (the whole model's fake step costs minutes at 48 layers): the same bytes as tracking all 12 layers, FSDP over 2
    ranks. Each layer adds the same tensors, so the only difference allowed is the integer division's, under a
    byte per layer."""
    from qwen3_titan_testing.checkpoints import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "deep", config_changes={"num_hidden_layers": 12})
    env = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", _DEEP, str(tmp_path / "out"), str(model)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    extrapolated, depths, tracked = json.loads(proc.stdout.strip().splitlines()[-1])
    assert depths == [[2, 4], 12]
    assert tracked["activations"] > 0 and tracked["params"] > 0
    for kind, nbytes in tracked.items():
        assert abs(extrapolated[kind] - nbytes) <= 12, (kind, extrapolated, tracked)


@pytest.mark.slow
def test_a_live_preference_reference_counts_its_copy_of_the_trained_weights(tmp_path):
    """``--dpo.reference live`` keeps the starting values of the weights that train, each rank its shards: as
    much as the parameters (their buffers apart), beside the step the fake step tracks."""
    proc = _dry_run(
        "--nproc", "64", "--config", "native_qwen3_4b", "--memory-per-rank", "trn2", "--objective", "dpo",
        "--dataloader.dataset", "default-pairs", "--dpo.reference", "live", "--out", str(tmp_path / "dry"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    kinds = dict(
        (name, float(gib))
        for name, gib in re.findall(r"([a-zA-Z ]+) ([0-9.]+)[,;]", proc.stdout.split("GiB: ")[1])
    )
    kinds = {name.strip(): gib for name, gib in kinds.items()}
    # 4.02B parameters in fp32 over 64 ranks: 0.23 GiB each; the parameters' figure adds the RoPE buffers.
    assert 0.2 < kinds["live reference"] <= kinds["params"] <= kinds["live reference"] + 0.02, proc.stdout
