"""The wrapper, its state-dict adapter and its parallelize function, in process (seconds)."""

from __future__ import annotations

import dataclasses
from importlib.metadata import entry_points

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from qwen3_titan_common.arch.architecture import architecture_from_config
from qwen3_titan_common.errors import UserInputError
from qwen3_titan_common.hf.expected_keys import EMBED, LM_HEAD, expected_hf_shapes
from qwen3_titan_common.hf.model_dir import open_model_dir
from qwen3_titan_common.hf.titan_load import read_hf_state_dict
from qwen3_titan_hf_v5 import config_registry
from qwen3_titan_hf_v5.model import HFCausalLM
from qwen3_titan_hf_v5.parallelize import parallelize_hf_v5
from qwen3_titan_hf_v5.state_dict_adapter import HFv5StateDictAdapter
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint, tiny_qwen3_config
from torch.distributed.fsdp import FSDPModule
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from transformers import AutoModelForCausalLM


def _config(*, moe=False, tied=True, **changes) -> HFCausalLM.Config:
    hf_config = tiny_qwen3_config(moe=moe, tied=tied).to_dict()
    return HFCausalLM.Config(hf_config=hf_config, **changes)


def _built(config: HFCausalLM.Config, seed: int = 0) -> HFCausalLM:
    model = config.build()
    torch.manual_seed(seed)
    model.init_weights(buffer_device=None)
    return model


def _tokens(vocab: int = 4096) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_parameter_names_are_transformers_names_and_logits_match(moe):
    config = _config(moe=moe)
    model = _built(config)
    reference = AutoModelForCausalLM.from_config(config.transformers_config()).eval()
    assert set(model.state_dict()) == set(reference.state_dict())
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(model.eval()(_tokens()), reference(_tokens()).logits)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_tie_follows_config_json_unless_untied_on_purpose(tied):
    model = _built(_config(tied=tied))
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert model.enable_weight_tying == tied
    untied = _built(_config(tied=tied, untie_embeddings=True))
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    assert not untied.enable_weight_tying


def test_random_init_is_the_native_backends_distribution():
    model = _built(_config())
    params = dict(model.named_parameters())
    assert torch.equal(params["model.norm.weight"], torch.ones(64))
    assert abs(params["model.layers.0.self_attn.q_proj.weight"].std().item() - 0.02) < 0.003
    assert model.model.embed_tokens.padding_idx is None  # the EOS (= pad) row trains too
    rotary = model.model.rotary_emb
    expected, _ = rotary.compute_default_rope_parameters(rotary.config)
    assert torch.equal(rotary.inv_freq, expected)


@pytest.mark.parametrize(
    ("moe", "tied", "untie"),
    [(False, True, False), (False, False, False), (False, True, True), (True, False, False)],
    ids=["tied", "untied", "untied-on-purpose", "moe"],
)
def test_to_hf_gives_the_checkpoint_layout_and_from_hf_inverts_it(moe, tied, untie):
    config = _config(moe=moe, tied=tied, untie_embeddings=untie)
    model = _built(config)
    adapter = HFv5StateDictAdapter(config, None)
    hf = adapter.to_hf(model.state_dict())
    arch = architecture_from_config(config.hf_config)
    expected = expected_hf_shapes(arch)
    if config.tie_word_embeddings:
        expected.pop(LM_HEAD)
    assert {k: tuple(v.shape) for k, v in hf.items()} == expected
    back = adapter.from_hf(dict(hf))
    state = model.state_dict()
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_moe_experts_split_as_transformers_loads_them(tmp_path):
    """Per-expert tensors written by transformers' save_pretrained fuse to transformers' own fused params."""
    source = make_tiny_checkpoint(tmp_path / "moe", moe=True, tied=False, with_tokenizer=False)
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    on_disk = read_hf_state_dict(open_model_dir(source))
    config = HFCausalLM.Config(hf_config=reference.config.to_dict())
    fused = HFv5StateDictAdapter(config, None).from_hf(on_disk)
    assert set(fused) == set(reference.state_dict())
    assert all(torch.equal(fused[k], v) for k, v in reference.state_dict().items())


def test_untied_model_reads_a_tied_checkpoints_embedding_into_lm_head(tmp_path):
    source = make_tiny_checkpoint(tmp_path / "tied", tied=True, with_tokenizer=False)
    config = _config(tied=True, untie_embeddings=True)
    model = config.build()
    adapter = HFv5StateDictAdapter(config, str(source))
    hf = adapter.to_hf({k: torch.zeros_like(v) for k, v in model.state_dict().items()})
    assert LM_HEAD in hf
    dcp.load(hf, storage_reader=adapter.get_hf_storage_reader(str(source)))
    state = adapter.from_hf(hf)
    assert torch.equal(state[LM_HEAD], state[EMBED]) and state[EMBED].abs().sum() > 0


def test_flops_and_parameters_follow_the_shared_convention():
    # The same config.json counts the same on every backend (perf.flops), whatever the model's code.
    from qwen3_titan_common.models.qwen3 import titan_qwen3_model_config
    from qwen3_titan_common.perf.flops import flops_breakdown

    config = config_registry.debug().model_spec.model
    with torch.device("meta"):
        model = config.build()
    nparams, flops = config.get_nparams_and_flops(model, seq_len=256)
    assert nparams == 4_197_120  # every parameter once: the tied embedding is lm_head
    assert flops == flops_breakdown(config_registry.debug().architecture, 256).per_token
    native = titan_qwen3_model_config(config_registry.debug().architecture)  # torchtitan's Qwen3
    with torch.device("meta"):
        native_model = native.build()
    assert native.get_nparams_and_flops(native_model, seq_len=256) == (nparams, flops)


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _parallelize(model, **training):
    parallelism = ParallelismConfig()
    dims = ParallelDims.from_config(parallelism, 1)
    dims.build_mesh()
    return parallelize_hf_v5(
        model, parallel_dims=dims, training=TrainingConfig(**training), parallelism=parallelism,
        compile_config=CompileConfig(), ac_config=None, dump_folder="",
    )  # fmt: skip


def test_fsdp_groups_per_layer_with_the_tied_weight_in_the_root(one_rank_group):
    with torch.device("meta"):
        model = _config(tied=True).build()
    model = _parallelize(model, mixed_precision_param="float32")
    assert all(isinstance(layer, FSDPModule) for layer in model.model.layers)
    assert isinstance(model, FSDPModule)
    # The embedding, final norm and lm_head are no group of their own: they are the root's.
    assert not any(
        isinstance(m, FSDPModule) for m in (model.model.embed_tokens, model.model.norm, model.lm_head)
    )
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=None)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    loss = model(_tokens()).float().logsumexp(-1).mean()
    loss.backward()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.grad is not None


def test_one_cpu_rank_trains_the_model_whole_and_keeps_the_tie(one_rank_group):
    # The model spec's parallelize: on one CPU rank no FSDP (models.fsdp_comms), bf16 by autocast.
    from qwen3_titan_common.assets import default_architecture
    from qwen3_titan_hf_v5.model import hf_v5_model_spec

    spec = hf_v5_model_spec(default_architecture(), "debug")
    with torch.device("meta"):
        model = spec.model.build()
    dims = ParallelDims.from_config(ParallelismConfig(), 1)
    dims.build_mesh()
    model = spec.parallelize_fn(
        model, parallel_dims=dims, training=TrainingConfig(mixed_precision_param="bfloat16"),
        parallelism=ParallelismConfig(), compile_config=CompileConfig(), ac_config=None, dump_folder="",
    )  # fmt: skip
    assert not any(isinstance(module, FSDPModule) for module in model.modules())
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=None)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert len({id(p) for p in model.parameters()}) == len(list(model.parameters()))
    assert model.model.embed_tokens.sparse  # its lookup's gradient as rows, added to the projection's
    logits = model(_tokens())
    assert logits.dtype == torch.bfloat16
    logits.float().logsumexp(-1).mean().backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    assert not any(p.grad.is_sparse for p in model.parameters())


def test_flex_is_refused_on_cpu_with_the_flag_named():
    from torchtitan.tools import utils

    if utils.device_type == "cuda":
        pytest.skip("this machine has CUDA, where flex is allowed")
    config = config_registry.debug()
    config.hf_v5.attention = "flex"
    with pytest.raises(ValueError, match=r"^--hf_v5.attention flex: .* use --hf_v5.attention sdpa"):
        config.model_spec.model.update_from_config(config=config)


@pytest.mark.parametrize("flag", ["tensor_parallel_degree", "pipeline_parallel_degree"])
def test_tensor_and_pipeline_parallelism_take_a_dense_model_and_refuse_a_moe_whose_experts_split(flag):
    dense = config_registry.debug()
    dense.parallelism = dataclasses.replace(dense.parallelism, **{flag: 2})
    dense.model_spec.model.update_from_config(config=dense)
    moe = config_registry.debug_moe()
    moe.parallelism = dataclasses.replace(moe.parallelism, **{flag: 2})
    moe_with_experts_split = config_registry.debug_moe()
    moe_with_experts_split.parallelism = dataclasses.replace(
        moe_with_experts_split.parallelism, expert_parallel_degree=2
    )
    moe_with_experts_split.model_spec.model.update_from_config(config=moe_with_experts_split)
    refusal = rf"^--parallelism.{flag} 2: this config.json is a Qwen3-MoE \(8 routed experts\)"
    # Before the rank writes anything (the trainer's checks), and in the model's own for a config built by hand.
    with pytest.raises(UserInputError, match=refusal):
        config_registry.HFv5Trainer.prepare_backend(moe)
    with pytest.raises(ValueError, match=refusal):
        moe.model_spec.model.update_from_config(config=moe)


def test_context_parallelism_runs_over_the_block_sparse_attention_only():
    config = config_registry.debug()
    config.parallelism = dataclasses.replace(config.parallelism, context_parallel_degree=2)
    config.hf_v5.attention = "blocks"
    config.model_spec.model.update_from_config(config=config)
    assert config.model_spec.model.document_attention() is not None
    config.hf_v5.attention = "sdpa"
    with pytest.raises(
        ValueError, match=r"^--parallelism.context_parallel_degree 2: .* not --hf_v5.attention sdpa"
    ):
        config.model_spec.model.update_from_config(config=config)


def test_config_functions_and_the_recipe_entry_point():
    for name, model_type, tied in [
        ("debug", "qwen3", True),
        ("debug_moe", "qwen3_moe", False),
        ("qwen3_0_6b", "qwen3", True),
        ("qwen3_1_7b", "qwen3", True),
        ("qwen3_4b", "qwen3", True),
        ("v5_qwen3_4b", "qwen3", True),
    ]:
        config = getattr(config_registry, name)()
        assert config.model_spec.model.hf_config["model_type"] == model_type
        assert config.model_spec.model.tie_word_embeddings == tied
        assert config.hf_v5.attention is None  # the device's default: blocks off CUDA, sdpa on CUDA
    assert config.model_spec.model.hf_config["rope_theta"] == 5e6  # 2507, not the "4B" flavor's 1e6
    assert config_registry.debug_moe().architecture.moe.num_experts == 8
    assert config_registry.debug_moe().architecture.vocab_size == 4096
    (recipe,) = entry_points(group="qwen3_titan.recipes", name="v5_qwen3_4b")
    assert recipe.load() is config_registry.v5_qwen3_4b


def test_cuda_graphs_go_off_for_flex_attention_only(monkeypatch):
    from qwen3_titan_hf_v5.config_registry import HFv5Trainer, debug
    from torchtitan.tools import utils as titan_utils

    monkeypatch.setattr(titan_utils, "device_type", "cuda")
    for attention, graphs_off in ((None, False), ("sdpa", False), ("flex", True), ("blocks", True)):
        config = debug()
        config.hf_v5.attention = attention
        config = HFv5Trainer.resolve_cuda_graphs(config)
        assert config.training.disable_cuda_graphs is graphs_off, attention


@pytest.mark.parametrize("implementation", ["blocks", "sdpa"])
def test_attention_keeps_each_packed_document_to_itself(implementation):
    # blocks: common's block-sparse attention, its block pairs built by the model's forward or, for a caller
    # passing positions alone, from position_ids. sdpa: transformers' SDPA under transformers' packed-sequence
    # mask, built at every call (so nothing differs between a CUDA graph capture and a plain step).
    import torch
    from qwen3_titan_common.models.document_blocks import document_blocks
    from qwen3_titan_hf_v5.attention import ATTENTION_IMPLEMENTATIONS, DOCUMENT_SDPA
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.masking_utils import create_causal_mask

    config = AutoConfig.for_model(
        "qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    ours = AutoModelForCausalLM.from_config(
        config, attn_implementation=ATTENTION_IMPLEMENTATIONS[implementation]
    ).eval()
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    reference.load_state_dict(ours.state_dict())
    from qwen3_titan_common.train.tolerance import ModelBounds

    tokens = torch.randint(0, 64, (2, 12))
    positions = torch.tensor([list(range(5)) + list(range(7)), list(range(12))])
    # One model computed two ways (another attention, another row length): the derived bound of a logit.
    architecture = architecture_from_config(config.to_dict())
    bound = ModelBounds.from_state_dict(architecture, ours.state_dict()).logit_atol(seq_len=12)
    with torch.no_grad():
        packed = ours(tokens, position_ids=positions, use_cache=False).logits
        assert torch.allclose(
            packed, reference(tokens, position_ids=positions, use_cache=False).logits, rtol=0, atol=bound
        )
        alone = ours(tokens[:1, 5:], position_ids=torch.arange(7)[None], use_cache=False).logits
        assert torch.allclose(packed[:1, 5:], alone, rtol=0, atol=bound)
        if implementation == "blocks":
            # The block pairs handed down once (as HFCausalLM.forward does), blocks of 4: documents across edges.
            blocks = document_blocks(positions, block_size=4)
            handed = ours(tokens, position_ids=positions, use_cache=False, document_blocks=blocks).logits
            assert torch.allclose(handed, packed, rtol=0, atol=bound)
            return
        embeds = ours.model.embed_tokens(tokens)
        single = torch.arange(12).expand(2, 12)  # one document per row: transformers' "sdpa" skips the mask
        for implementation, built in ((DOCUMENT_SDPA, True), ("sdpa", False)):
            config._attn_implementation = implementation
            mask = create_causal_mask(
                config=config, inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=single
            )
            assert (mask is not None) is built, implementation
