"""Qwen3-MoE on torchtitan with a kernel registry: NKI kernels on Trainium, reference kernels elsewhere.

``--module qwen3_titan_nki_moe`` (config functions in ``config_registry``). Kept import-light:
the launcher lists config functions without importing torch.
"""
