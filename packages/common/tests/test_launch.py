import os
import shutil
from pathlib import Path

import pytest
from qwen3_titan_common.launcher.launch import run
from qwen3_titan_common.launcher.plan import Backend, LaunchError, plan_launch, read_command_line
from qwen3_titan_common.runtime.neuron_env import NEURON_ENV_DEFAULTS, neuron_env_updates

NATIVE = Backend(distribution="native-backend", module="qwen3_titan_native")
RECIPE_FLAGS = ["--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", "--local-ranks-filter", "0"]


def test_default_nproc_is_the_device_count(monkeypatch):
    monkeypatch.setenv("QWEN3_TITAN_DEVICE", "cpu")
    _, plan = plan_launch(NATIVE, [])
    assert plan.nproc_per_node == 1 and plan.config == "debug"


def test_multi_node_flags_become_torchrun_rendezvous():
    _, plan = plan_launch(
        NATIVE, ["--nproc", "64", "--nnodes", "4", "--node-rank", "2", "--rdzv-endpoint", "h0:29400"]
    )
    args = plan.torchrun_args()
    assert "--nnodes=4" in args and "--node_rank=2" in args
    assert args[args.index("--rdzv_endpoint") + 1] == "h0:29400"
    assert plan.world_size == 256


@pytest.mark.parametrize(
    "flags",
    [
        ["--nproc_per_node", "8", "--node_rank", "1", "--rdzv_endpoint", "h0:29400"],
        ["--nproc_per_node=8", "--node_rank=1", "--rdzv_endpoint=h0:29400"],
        ["--nproc-per-node", "8", "--node-rank", "1", "--rdzv-endpoint", "h0:29400"],
    ],
    ids=["torchrun-underscores", "torchrun-equals", "dashes"],
)
def test_torchrun_spellings_of_the_launcher_flags(flags):
    _, plan = plan_launch(NATIVE, [*flags, "--nnodes", "2"])
    args = plan.torchrun_args()
    assert plan.nproc_per_node == 8 and plan.world_size == 16
    assert "--node_rank=1" in args and args[args.index("--rdzv_endpoint") + 1] == "h0:29400"
    assert not any(arg.startswith(("--nproc", "--node", "--rdzv")) for arg in plan.passthrough)


def test_slurm_environment_is_used_when_flags_are_absent(monkeypatch):
    monkeypatch.setenv("SLURM_NNODES", "2")
    monkeypatch.setenv("SLURM_NODEID", "1")
    monkeypatch.setenv("MASTER_ADDR", "node-a")
    monkeypatch.setenv("MASTER_PORT", "29555")
    _, plan = plan_launch(NATIVE, ["--nproc", "8"])
    assert (plan.nnodes, plan.node_rank, plan.rdzv_endpoint) == (2, 1, "node-a:29555")


def test_multi_node_without_endpoint_names_the_flag(monkeypatch):
    for name in ("MASTER_ADDR", "RDZV_ENDPOINT", "SLURM_NNODES"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(LaunchError, match="--nnodes=2 needs --rdzv-endpoint"):
        plan_launch(NATIVE, ["--nproc", "8", "--nnodes", "2"])


def test_node_rank_out_of_range_is_named():
    with pytest.raises(LaunchError, match="--node-rank=3"):
        plan_launch(NATIVE, ["--nproc", "8", "--nnodes", "2", "--node-rank", "3", "--rdzv-endpoint", "h:1"])


def test_bad_nproc_is_named():
    with pytest.raises(LaunchError, match="--nproc=0: expected a positive integer"):
        plan_launch(NATIVE, ["--nproc", "0"])


def test_unknown_module_is_named(capsys):
    assert run(NATIVE, ["--nproc", "1", "--module", "no_such_backend_module"]) == 2
    assert "--module no_such_backend_module" in capsys.readouterr().err


def test_neuron_env_never_overrides_the_user():
    env = {"NEURON_LOGICAL_NC_CONFIG": "1"}
    updates = neuron_env_updates(env)
    assert "NEURON_LOGICAL_NC_CONFIG" not in updates
    assert set(updates) == set(NEURON_ENV_DEFAULTS) - {"NEURON_LOGICAL_NC_CONFIG"}


def test_print_cmd_shows_neuron_env_prefix():
    from qwen3_titan_common.launcher.plan import LaunchPlan

    plan = LaunchPlan("m", "c", 64, 1, 0, "localhost:0", [], env_updates={"NEURON_LOGICAL_NC_CONFIG": "2"})
    assert plan.shell_line().startswith("NEURON_LOGICAL_NC_CONFIG=2 torchrun --nproc_per_node=64 ")


# -- the shared `train` script: which backend --------------------------------------

BACKENDS = {
    "hf-v5-backend": Backend("hf-v5-backend", "qwen3_titan_hf_v5"),
    "native-backend": NATIVE,
}


def test_backend_env_variable_wins(monkeypatch):
    from qwen3_titan_common.launcher.dispatch import choose_backend

    monkeypatch.setenv("QWEN3_TITAN_BACKEND", "hf-v5-backend")
    assert (
        choose_backend(BACKENDS, read_command_line(["--module", "qwen3_titan_native"]))[0].distribution
        == "hf-v5-backend"
    )


def test_unknown_backend_env_variable_is_named(monkeypatch):
    from qwen3_titan_common.launcher.dispatch import choose_backend

    monkeypatch.setenv("QWEN3_TITAN_BACKEND", "tpu-backend")
    backend, why = choose_backend(BACKENDS, read_command_line([]))
    assert (
        backend is None
        and "QWEN3_TITAN_BACKEND=tpu-backend" in why
        and "hf-v5-backend, native-backend" in why
    )


def test_module_flag_selects_its_backend(monkeypatch):
    from qwen3_titan_common.launcher.dispatch import choose_backend

    monkeypatch.delenv("QWEN3_TITAN_BACKEND", raising=False)
    assert (
        choose_backend(BACKENDS, read_command_line(["--module=qwen3_titan_hf_v5"]))[0].distribution
        == "hf-v5-backend"
    )


def test_several_backends_and_no_choice_is_an_error_that_says_how(monkeypatch):
    from qwen3_titan_common.launcher.dispatch import choose_backend

    monkeypatch.delenv("QWEN3_TITAN_BACKEND", raising=False)
    backend, why = choose_backend(BACKENDS, read_command_line(["--training.steps", "3"]))
    assert backend is None and "uv run --package NAME train" in why


def test_a_single_installed_backend_needs_no_choice(monkeypatch):
    from qwen3_titan_common.launcher.dispatch import choose_backend

    monkeypatch.delenv("QWEN3_TITAN_BACKEND", raising=False)
    assert choose_backend({"native-backend": NATIVE}, read_command_line([]))[0] is NATIVE


def test_uv_run_package_is_read_from_the_parent_process(tmp_path):
    # A real parent named `uv` running `run --package hf-v5-backend ...`: a tiny shell script.
    import os
    import subprocess
    import sys

    fake_uv = tmp_path / "uv"
    fake_uv.write_text('#!/bin/sh\n"$PYTHON" -c "$CODE"\n')
    fake_uv.chmod(0o755)
    code = "from qwen3_titan_common.launcher.dispatch import _uv_parent_package as f; print(f())"
    env = {**os.environ, "PYTHON": sys.executable, "CODE": code}
    out = subprocess.run(
        [str(fake_uv), "run", "--package", "hf-v5-backend", "train"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "hf-v5-backend"


def test_config_functions_made_by_a_factory_are_listed_with_their_doc(tmp_path, monkeypatch):
    # `name = CONFIGS.published(..., doc="...")` is a config function too (train.config_functions).
    from qwen3_titan_common.launcher.config_names import list_config_functions

    package = tmp_path / "my_backend"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "config_registry.py").write_text(
        "def debug():\n    '''The tiny one.'''\n\n"
        "qwen3_1_7b = _CONFIGS.published('qwen3_1_7b', 'Qwen3-1.7B', doc='Qwen3-1.7B shape.\\nMore.')\n"
        "_private = _CONFIGS.published('x', 'y', doc='hidden')\n"
        "not_a_config = some_call(1)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    functions = list_config_functions("my_backend")
    assert [(f.name, f.summary) for f in functions] == [
        ("debug", "The tiny one."),
        ("qwen3_1_7b", "Qwen3-1.7B shape."),
    ]


# A program torchrun runs in the tests below: step lines on stdout, then a failure, as a rank's would be.
FAILING_RANK = """
import sys
from qwen3_titan_common.errors import UserInputError
from qwen3_titan_common.protocols.rank_errors import record_uncaught_errors

record_uncaught_errors()  # as every config function does
for step in (1, 2):
    print(f"step: {step}/30  loss: 5.0", flush=True)
    print(f"a warning on stderr at step {step}", file=sys.stderr, flush=True)
if sys.argv[1] == "user":
    raise UserInputError("data.jsonl:84: not JSON")
raise RuntimeError("boom")
"""


@pytest.mark.parametrize(
    ("kind", "code", "last"),
    [
        ("user", 2, "train: data.jsonl:84: not JSON"),
        ("internal", 1, "train: internal error in rank 0: RuntimeError: boom"),
    ],
)
def test_a_failing_rank_shows_its_log_and_one_line_and_its_stderr_stays_in_the_log(
    tmp_path, capfd, kind, code, last
):
    """Real torchrun, one rank: its stdout live, its stderr (a warning, its traceback or stop line) and
    torchrun's report in the log only, and the last line from its recorded error, read after torchrun ends."""
    from qwen3_titan_common.launcher.supervise import run_torchrun, torchrun_executable

    (tmp_path / "failing_rank.py").write_text(FAILING_RANK)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop("QWEN3_TITAN_SHOW_TRACEBACK", None)
    command = [torchrun_executable(), "--nproc_per_node=1", "--rdzv_backend", "c10d", "--rdzv_endpoint",
               "localhost:0", "--tee", "3", "-m", "failing_rank", kind]  # fmt: skip
    rc, summary = run_torchrun(command, env)
    out, err = capfd.readouterr()
    assert (rc, summary) == (code, None)
    assert [line for line in out.splitlines() if "step:" in line][-1].endswith("step: 2/30  loss: 5.0")
    assert "warning" not in out + err and "Traceback" not in out + err and "[stopped]" not in out + err
    assert err.splitlines()[0].startswith("[train] ") and err.splitlines()[-1].startswith(last)
    assert len(err.splitlines()) == 2  # the first line and the last
    if kind == "internal":
        log = Path(err.splitlines()[-1].split("the full log is in ")[1].split(" (")[0])
        text = log.read_text()
        assert "a warning on stderr at step 2" in text and "RuntimeError: boom" in text
        shutil.rmtree(log.parent)


def test_a_ranks_user_error_wins_over_another_ranks_internal_error(tmp_path):
    import json

    from qwen3_titan_common.launcher.rank_files import ROOT_CAUSE_FILE, RankFiles

    def record(path, message):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"message": {"message": message, "extraInfo": {"timestamp": "1"}}}))

    record(tmp_path / ROOT_CAUSE_FILE, "RuntimeError: Connection closed by peer")  # rank 0, same second
    record(tmp_path / "run" / "attempt_0" / "0" / "error.json", "RuntimeError: Connection closed by peer")
    files = RankFiles(tmp_path)
    assert files.root_cause() == "RuntimeError: Connection closed by peer"
    record(tmp_path / "run" / "attempt_0" / "1" / "error.json", "UserInputError: d.jsonl:9: bad")
    assert files.root_cause() == "UserInputError: d.jsonl:9: bad"


_INTERRUPTED_LINE = """
import json, sys
from qwen3_titan_common.launcher.supervise import _interrupted_line
from qwen3_titan_common.protocols.summary import RunRecord

said = [_interrupted_line(RunRecord("out", sys.argv[1], last_step=5, interrupted_with_checkpoint=step))
        for step in (4, -1)]
print(json.dumps([said, "torch" in sys.modules]))
"""


def test_an_interrupted_runs_last_line_names_the_checkpoint_its_rank_read(tmp_path):
    """The rank reads its newest complete checkpoint on its way out; the launcher names it without reading DCP's
    files itself (which would import torch after torchrun has already exited). The folder here holds a step-6
    that does not read whole, so a line read from the disk would say so."""
    import json
    import subprocess
    import sys

    (tmp_path / "step-6").mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", _INTERRUPTED_LINE, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (with_step, without), imported_torch = json.loads(proc.stdout)
    assert with_step.startswith("interrupted at step 5; newest complete checkpoint: step 4 (")
    assert without.startswith("interrupted at step 5; no complete checkpoint yet")
    assert not imported_torch


_FAILING_REGISTRY = """
from qwen3_titan_common.assets import default_architecture as _arch
from qwen3_titan_common.models.qwen3 import titan_qwen3_model_spec as _spec
from qwen3_titan_common.train.config_functions import BackendConfigs as _Configs

_CONFIGS = _Configs("failing", _spec)


def debug():
    '''A config function that fails after it has built its config, as a bug of ours would.'''
    _CONFIGS.tiny(_arch(), "debug")
    raise RuntimeError("a bug in the config function")
"""


def test_a_rehearsal_that_fails_inside_is_one_line_and_its_output_on_request(tmp_path, monkeypatch, capfd):
    """The dry run is rank 0 rehearsed in a child process (launcher.rehearse): an internal error there is
    the launcher's one line, exit 1, with the child's own output (its traceback) shown only when asked."""
    package = tmp_path / "failing_backend"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "config_registry.py").write_text(_FAILING_REGISTRY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.chdir(tmp_path)
    backend = Backend(distribution="failing-backend", module="failing_backend")
    for shown in ("0", "1"):
        monkeypatch.setenv("QWEN3_TITAN_SHOW_TRACEBACK", shown)
        assert run(backend, ["--dry-run", "--nproc", "2"]) == 1
        out = capfd.readouterr()
        line = out.err.strip().splitlines()[-1]
        assert line.startswith("train: internal error in the dry run (rank 0 rehearsed in a child process): ")
        assert "RuntimeError: a bug in the config function" in line
        assert ("Traceback (most recent call last)" in out.err) == (shown == "1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["failing_backend"]  # nothing written


def test_a_rehearsal_set_by_hand_is_refused_before_it_lays_anything_out():
    """--rehearsal.mode is the launcher's: without its report file and torchtitan's fake process group, a rank
    would lay the job out on real process groups and say nothing."""
    from qwen3_titan_common.assets import default_architecture
    from qwen3_titan_common.errors import UserInputError
    from qwen3_titan_common.models.qwen3 import titan_qwen3_model_spec
    from qwen3_titan_common.train.config_functions import BackendConfigs
    from qwen3_titan_common.train.rehearsal import Rehearsal

    config = BackendConfigs("hand", titan_qwen3_model_spec).tiny(default_architecture(), "debug")
    assert config.rehearsal.mode == ""  # a config function builds a run, not a rehearsal
    config.rehearsal = Rehearsal.Config(mode="dry_run")
    with pytest.raises(UserInputError, match=r"^--rehearsal.mode dry_run: the train launcher sets it"):
        config.build()
    config.rehearsal = Rehearsal.Config(mode="dry_run", report="report.jsonl")  # still not the fake backend
    with pytest.raises(UserInputError, match="--comm.mode fake_backend"):
        config.build()
