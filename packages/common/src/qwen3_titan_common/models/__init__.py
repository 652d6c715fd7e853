"""torchtitan's Qwen3 / Qwen3-MoE model configs, built from an architecture."""
