"""``uv run --package hf-v5-backend train``: see qwen3_titan_common.cli.launch."""

from qwen3_titan_common.cli.launch import main_for
from qwen3_titan_common.cli.plan import Backend

BACKEND = Backend(
    distribution="hf-v5-backend",
    module="qwen3_titan_hf_v5",
    eval_model="qwen3_titan_hf_v5.eval_model:hf_v5_model",
)

main = main_for(BACKEND)

if __name__ == "__main__":
    main()
