"""Shared pieces of the Qwen3 torchtitan toolkit.

Nothing here imports torchtitan at import time: the device shim must be in place
before torchtitan's import-time device detection runs (see `device.py`).
"""

__version__ = "0.1.0"
