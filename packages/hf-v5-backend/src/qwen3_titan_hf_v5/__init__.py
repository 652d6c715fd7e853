"""hf-v5-backend: transformers v5 ``AutoModelForCausalLM`` trained through torchtitan.

``--module qwen3_titan_hf_v5``. Kept free of imports: the launcher imports this package
before it starts any rank.
"""
