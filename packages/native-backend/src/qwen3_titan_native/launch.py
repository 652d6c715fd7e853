"""``uv run --package native-backend train``: see qwen3_titan_common.launch."""

from qwen3_titan_common.launch import Backend, main_for

BACKEND = Backend(distribution="native-backend", module="qwen3_titan_native")

main = main_for(BACKEND)

if __name__ == "__main__":
    main()
