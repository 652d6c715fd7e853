"""The NKI shape rules: one line naming the flag and the nearest valid value, before anything runs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from nki_moe_models import QWEN3_30B_A3B_SHAPE, kernel_shape
from qwen3_titan_nki_moe import config_registry, constraints, registry
from qwen3_titan_nki_moe.trainer import prepare_kernels


def _shape(**changes):
    return kernel_shape(QWEN3_30B_A3B_SHAPE, **changes)


def _messages(**changes):
    return [v.message() for v in constraints.violations(_shape(**changes))]


def test_the_recipe_shapes_pass():
    assert constraints.violations(_shape()) == []


def test_sequence_length_names_the_flag_and_nearest_multiple():
    assert _messages(seq_len=1000)[0] == (
        "--training.seq_len 1000: the NKI rope_hf kernel needs a multiple of 256 (128 x LNC=2); nearest valid: 1024"
    )
    assert _messages(seq_len=1000, lnc=1)[0].endswith(
        "needs a multiple of 128 (128 x LNC=1); nearest valid: 1024"
    )
    assert _messages(seq_len=100)[0].endswith("nearest valid: 256")


def test_sequence_longer_than_the_rope_cache():
    assert _messages(seq_len=8192, rope_cache_len=2048) == [
        "--training.seq_len 8192: the NKI rope_hf kernel needs at most the RoPE cache length 2048 "
        "(max_position_embeddings); nearest valid: 2048"
    ]


@pytest.mark.parametrize(("head_dim", "nearest"), [(8194, 8192), (63, 62)])
def test_head_dim(head_dim, nearest):
    assert _messages(head_dim=head_dim) == [
        f"config.json head_dim {head_dim}: the NKI rope_hf kernel needs an even head_dim <= 8192; nearest valid: {nearest}"
    ]


def test_head_dim_over_128_is_fine():
    # head_dim is on the kernel's free axis: 256 (and anything even up to 8192) runs.
    assert _messages(head_dim=256) == []


def test_expert_parallel_degree_must_divide_the_experts():
    assert _messages(ep_degree=48) == [
        "--parallelism.expert_parallel_degree 48: the NKI grouped_swiglu kernel needs a divisor of the expert "
        "count 128; nearest valid: 32"
    ]


def test_moe_sizes():
    assert _messages(moe_intermediate_size=1000) == [
        "config.json moe_intermediate_size 1000: the NKI grouped_swiglu kernel needs a multiple of 256 "
        "(128 x LNC=2); nearest valid: 1024"
    ]
    assert _messages(hidden_size=2000)[0].startswith(
        "config.json hidden_size 2000: the NKI grouped_swiglu kernel needs a multiple of 128"
    )


def test_one_experts_weights_must_fit_sbuf():
    # Qwen3-235B-A22B's experts (hidden 4096, moe_intermediate 1536): 768 rows per core do not fit.
    assert _messages(hidden_size=4096, moe_intermediate_size=1536) == [
        "config.json moe_intermediate_size 1536: the NKI grouped_swiglu kernel needs one expert's weights "
        "in SBUF at hidden_size 4096 (kernel_limits.grouped_swiglu_bytes, fp32); nearest valid: 256"
    ]
    assert _messages(moe_intermediate_size=1024) == []  # hidden 2048: 512 rows per core is the fp32 limit
    assert _messages(moe_intermediate_size=1280)[0].endswith("nearest valid: 1024")


def test_nearest_helpers():
    assert constraints.nearest_multiple(1000, 256) == 1024
    assert constraints.nearest_multiple(1, 256) == 256
    assert constraints.nearest_multiple(384, 256) == 512  # ties round up
    assert constraints.nearest_divisor(3, 8) == 2  # ties pick the smaller
    assert constraints.nearest_divisor(48, 128) == 32


@pytest.mark.parametrize(
    "name", ["debug_moe", "qwen3_30b_a3b_4layers", "qwen3_30b_a3b", "qwen3_nki_moe_config"]
)
def test_every_config_meets_the_nki_rules(name, monkeypatch):
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    config = getattr(config_registry, name)()
    assert constraints.violations(constraints.kernel_shape(config)) == []


def test_trainer_preparation_fails_fast_for_nki_on_any_device(monkeypatch):
    monkeypatch.delenv("QWEN3_TITAN_DEVICE", raising=False)
    config = config_registry.debug_moe()
    config.kernels = "nki"
    config.training.seq_len = 1000
    with pytest.raises(
        constraints.KernelConstraintError, match=r"^--training.seq_len 1000: .*nearest valid: 1024$"
    ):
        prepare_kernels(config)
    config.training.seq_len = 512
    with pytest.raises(registry.KernelSelectionError, match="^--kernels nki: no Neuron device"):
        prepare_kernels(config)


def _precheck(argv: list[str]) -> str | None:
    """The backend's check, as each rank and --dry-run run it, on the config torchtitan parses."""
    from qwen3_titan_common.errors import UserInputError
    from qwen3_titan_common.launcher.plan import plan_launch
    from qwen3_titan_common.train.trainer import Qwen3Trainer
    from qwen3_titan_nki_moe import BACKEND
    from torchtitan.config import ConfigManager

    _, plan = plan_launch(BACKEND, ["--nproc", "1", *argv])
    config = ConfigManager().parse_args(plan.titan_args())
    try:
        Qwen3Trainer.for_config(config).prepare_backend(config)
    except UserInputError as err:
        return str(err)
    return None


def test_backend_check_in_process(monkeypatch):
    assert _precheck(["--training.seq_len", "1000"]) is None  # NKI not requested: no check
    assert _precheck(["--kernels", "nki", "--training.seq_len", "1000"]) == (
        "--training.seq_len 1000: the NKI rope_hf kernel needs a multiple of 256 (128 x LNC=2); nearest valid: 1024"
    )
    # The mode is read from the config torchtitan parses, so every spelling of the flag counts.
    # (torchtitan itself refuses EP > 1 with CUDA graphs enabled, whatever the device)
    assert _precheck(
        ["--kernels=nki", "--parallelism.expert_parallel_degree", "3", "--training.disable_cuda_graphs"]
    ).startswith(
        "--parallelism.expert_parallel_degree 3: the NKI grouped_swiglu kernel needs a divisor of the expert count 8"
    )
    assert _precheck(["--kernels", "reference", "--training.seq_len", "1000"]) is None
    # The last of two flags wins, as in the run itself.
    assert _precheck(["--kernels", "nki", "--kernels", "auto", "--training.seq_len", "1000"]) is None


def test_launcher_ends_with_one_line(tmp_path):
    # The shared `train` script, choosing this backend as `uv run --package nki-moe-backend train` does.
    train = str(Path(sys.executable).with_name("train"))
    env = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": "nki-moe-backend"}
    proc = subprocess.run(
        [train, "--kernels", "nki", "--training.seq_len", "1000"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "train: --training.seq_len 1000: the NKI rope_hf kernel needs a multiple of 256 (128 x LNC=2); nearest valid: 1024"
    )
    # The rank refused it before writing anything, and said so without a traceback.
    assert list(tmp_path.iterdir()) == [] and "Traceback" not in proc.stdout + proc.stderr
