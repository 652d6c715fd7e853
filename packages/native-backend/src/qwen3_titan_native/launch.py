"""``uv run --package native-backend train``: see qwen3_titan_common.cli.launch."""

from qwen3_titan_common.cli.launch import main_for
from qwen3_titan_common.cli.plan import Backend

BACKEND = Backend(
    distribution="native-backend",
    module="qwen3_titan_native",
    eval_model="qwen3_titan_common.hf.eval_models:native_qwen3",
)

main = main_for(BACKEND)

if __name__ == "__main__":
    main()
