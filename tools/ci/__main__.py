"""``python -m tools.ci``: see the package docstring."""

import sys

# The package jobs run whichever interpreter `uv run --no-project` finds; say so in one line if too old.
if sys.version_info < (3, 11):  # noqa: UP036
    sys.exit(f"tools.ci: needs Python 3.11+ (tomllib); this is {sys.version.split()[0]}")

from tools.ci.cli import main  # noqa: E402

sys.exit(main())
