import sys
from pathlib import Path

# pytest runs with --import-mode=importlib: make the shared test helpers (nki_moe_models) importable.
sys.path.insert(0, str(Path(__file__).parent))
