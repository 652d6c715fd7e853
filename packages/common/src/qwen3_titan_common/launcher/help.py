"""``train --help``: the launcher's flags, then the chosen config's torchtitan flags as torchtitan shows them.

torchtitan's help is its own: ``ConfigManager.parse_args([... "--help"])`` runs tyro on the config function's
``Trainer.Config`` (defaults are that config's values), grouped by section as ``python -m torchtitan.train
--module M --config C --help`` prints them. It runs in this process rather than in a second interpreter: both
import torch and torchtitan, and the subprocess also pays an interpreter start and ``torchtitan.train``'s
imports (measured in docs/performance.md).
"""

from __future__ import annotations

import sys

from qwen3_titan_common.errors import UserInputError
from qwen3_titan_common.launcher.plan import Backend, CommandLine, check_config_name, launcher_parser


def print_help(backend: Backend, line: CommandLine) -> int:
    launcher_parser(backend).print_help()
    module = line.opts.module or backend.module
    config = line.opts.config or backend.default_config
    print(f"\ntorchtitan's flags for --module {module} --config {config} (defaults: that config's values):\n")
    sys.stdout.flush()
    try:
        check_config_name(module, config)
    except UserInputError as err:
        print(f"train: {err}", file=sys.stderr)
        return 2
    from torchtitan.config.manager import ConfigManager

    # tyro names the program after argv[0], the console script's full path.
    program, sys.argv[0] = sys.argv[0], "train"
    try:
        ConfigManager().parse_args(["--module", module, "--config", config, "--help"])
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else 0
    finally:
        sys.argv[0] = program
    return 0
