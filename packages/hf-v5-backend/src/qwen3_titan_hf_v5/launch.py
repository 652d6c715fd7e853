"""``uv run --package hf-v5-backend train``: see qwen3_titan_common.cli.launch."""

from qwen3_titan_common.cli.launch import main_for
from qwen3_titan_common.cli.plan import Backend


def hf_v5_precheck(config) -> str | None:
    """The parallelisms this backend does not implement, refused before any rank starts (the model's
    ``update_from_config`` refuses them again inside the rank, for the upstream torchrun form)."""
    from qwen3_titan_hf_v5.parallelize import check_parallelism

    try:
        check_parallelism(config.parallelism)
    except ValueError as err:
        return str(err)
    return None


BACKEND = Backend(
    distribution="hf-v5-backend",
    module="qwen3_titan_hf_v5",
    preflight=hf_v5_precheck,
    eval_model="qwen3_titan_hf_v5.eval_model:hf_v5_model",
)

main = main_for(BACKEND)

if __name__ == "__main__":
    main()
