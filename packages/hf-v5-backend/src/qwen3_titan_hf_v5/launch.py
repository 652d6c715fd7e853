"""``uv run --package hf-v5-backend train``: see qwen3_titan_common.launch."""

from qwen3_titan_common.launch import Backend, main_for

BACKEND = Backend(distribution="hf-v5-backend", module="qwen3_titan_hf_v5")

main = main_for(BACKEND)

if __name__ == "__main__":
    main()
