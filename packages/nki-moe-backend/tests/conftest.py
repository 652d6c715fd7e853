import sys
from pathlib import Path

import pytest
from qwen3_titan_nki_moe import registry

# pytest runs with --import-mode=importlib: make the shared test helpers (nki_moe_models) importable.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _fresh_kernel_choices():
    """Every test chooses kernels from scratch (the registry is process-global)."""
    registry.reset()
    yield
    registry.reset()
