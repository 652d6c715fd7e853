"""Where things are: the repository root (each child's working folder), our packages' sources, compat/."""

from __future__ import annotations

import glob
import os

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# Put on the children's PYTHONPATH: the GPU image has our packages only as sources, never installed.
SRC_DIRS = sorted(glob.glob(os.path.join(ROOT, "packages", "*", "src")))
# First on the children's PYTHONPATH: its sitecustomize applies the torch polyfills (compat/sitecustomize.py).
COMPAT = os.path.join(HERE, "compat")
