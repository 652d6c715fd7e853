"""The recipe's config name resolves to the nki-moe backend through neuron_qwen3."""


def test_neuron_qwen3_forwards_qwen3_nki_moe_config():
    from neuron_qwen3.config_registry import missing_provider, qwen3_nki_moe_config
    from qwen3_titan_nki_moe.overrides import KERNEL_OVERRIDES
    from qwen3_titan_nki_moe.trainer import NkiMoETrainer

    assert missing_provider("qwen3_nki_moe_config") is None
    config = qwen3_nki_moe_config()
    assert type(config) is NkiMoETrainer.Config
    assert config.model_spec.flavor == "qwen3_nki_moe_config"
    assert config.override.imports == list(KERNEL_OVERRIDES)
    assert config.architecture.moe.num_experts == 128
