"""`train --max-restarts N` becomes torchrun's own flag, with the fresh store per restart it needs."""

import pytest
from qwen3_titan_common.launcher.elastic import FRESH_STORE_PER_RESTART, restart_env_updates
from qwen3_titan_common.launcher.launch import run
from qwen3_titan_common.launcher.plan import Backend, LaunchError, plan_launch

NATIVE = Backend(distribution="native-backend", module="qwen3_titan_native")
FRESH_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


@pytest.fixture(autouse=True)
def _no_cluster_env(monkeypatch):
    for name in (FRESH_STORE, "SLURM_JOB_ID", "SLURM_NNODES", "SLURM_NODEID", "MASTER_ADDR", "RDZV_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)


def test_max_restarts_is_torchruns_flag_with_a_fresh_store_per_restart():
    _, plan = plan_launch(NATIVE, ["--nproc", "2", "--max-restarts", "3"])
    assert "--max-restarts=3" in plan.torchrun_args()
    assert plan.env_updates == {FRESH_STORE: "1"}
    # --print-cmd users copy the variable with the command.
    assert plan.shell_line().startswith(f"{FRESH_STORE}=1 torchrun ")


def test_without_restarts_nothing_changes():
    _, plan = plan_launch(NATIVE, ["--nproc", "2"])
    assert not any("restarts" in arg for arg in plan.torchrun_args())
    assert plan.env_updates == {} and plan.max_restarts == 0


def test_the_users_own_store_setting_wins(monkeypatch):
    monkeypatch.setenv(FRESH_STORE, "0")
    _, plan = plan_launch(NATIVE, ["--nproc", "2", "--max_restarts=1"])
    assert FRESH_STORE not in plan.env_updates and "--max-restarts=1" in plan.torchrun_args()
    assert restart_env_updates(1, {}) == FRESH_STORE_PER_RESTART


@pytest.mark.parametrize("value", ["-1", "two", "1.5"])
def test_a_bad_max_restarts_is_named(value):
    with pytest.raises(LaunchError, match=f"--max-restarts='{value}': expected 0 or a positive integer"):
        plan_launch(NATIVE, ["--nproc", "2", f"--max-restarts={value}"])


def test_a_bad_max_restarts_is_one_line_and_exit_2(capsys):
    assert run(NATIVE, ["--nproc", "2", "--max-restarts", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["train: --max-restarts='-1': expected 0 or a positive integer"]


def test_slurm_job_id_names_the_rendezvous(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    _, plan = plan_launch(NATIVE, ["--nproc", "8", "--nnodes", "2", "--rdzv-endpoint", "h0:29400"])
    assert "--rdzv-id=4242" in plan.torchrun_args()
    _, plan = plan_launch(NATIVE, ["--nproc", "8", "--rdzv-id", "mine"])
    assert "--rdzv-id=mine" in plan.torchrun_args()
