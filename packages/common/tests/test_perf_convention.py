import pytest
import torch
from qwen3_titan_common.arch.architecture import architecture_from_config
from qwen3_titan_common.arch.published import PUBLISHED_CONFIGS, published_architecture
from qwen3_titan_common.assets import default_architecture
from qwen3_titan_common.models.qwen3 import titan_qwen3_model_spec
from qwen3_titan_common.perf.flops import flops_breakdown, flops_per_token
from qwen3_titan_common.perf.peaks import peak_flops
from qwen3_titan_common.perf.train_log import parse_step_lines

TINY_MOE = {
    **PUBLISHED_CONFIGS["Qwen3-30B-A3B"], "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 8,
    "num_experts_per_tok": 2, "vocab_size": 256,
}  # fmt: skip


def _built_params(arch) -> int:
    with torch.device("meta"):
        model = titan_qwen3_model_spec(arch, "t").model.build()
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "arch",
    [default_architecture(), published_architecture("Qwen3-8B"), architecture_from_config(TINY_MOE)],
    ids=["tied-dense", "untied-dense", "moe"],
)
def test_total_parameters_match_the_built_model(arch):
    assert flops_breakdown(arch, 128).total_params == _built_params(arch)


def test_moe_counts_only_active_experts():
    arch = architecture_from_config(TINY_MOE)
    active = flops_breakdown(arch, 128).matmul_params
    all_experts = flops_breakdown(
        arch.with_changes(moe=arch.moe.__class__(**{**arch.moe.__dict__, "num_experts_per_tok": 8})), 128
    )
    expert = 3 * 64 * 32
    assert all_experts.matmul_params - active == 2 * 6 * expert  # 2 layers x 6 more experts each


def test_causal_halving_halves_only_the_attention_term():
    arch = published_architecture("Qwen3-1.7B")
    dense, causal = flops_breakdown(arch, 4096), flops_breakdown(arch, 4096, causal=True)
    assert causal.attention_flops * 2 == dense.attention_flops
    assert dense.per_token - causal.per_token == dense.attention_flops // 2
    # 1.7B: 6 x ~1.7e9 plus attention 12 x 28 x 16 x 128 x 4096.
    assert dense.attention_flops == 12 * 28 * 16 * 128 * 4096
    assert 9.5e9 < 6 * dense.matmul_params < 1.2e10


def test_tied_embedding_is_counted_once_as_lm_head():
    arch = default_architecture()
    assert flops_per_token(arch, 256) == 6 * flops_breakdown(arch, 256).matmul_params + 12 * 4 * 4 * 64 * 256


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H200", 989),
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA A100-SXM4-80GB", 312),
    ],
)
def test_gpu_peaks_are_torchtitans(name, tflops):
    from torchtitan.tools.utils import get_peak_flops

    peak, source = peak_flops("cuda", name, titan_peak=get_peak_flops(name))
    assert peak == pytest.approx(tflops * 1e12) and source == f"torchtitan's table for {name}"


@pytest.mark.parametrize(("name", "tflops"), [("trn2", 158), ("trn1", 95), ("trn3", 167.75)])
def test_trainium_peaks_are_ours(name, tflops):
    # torchtitan's table has no Trainium: without ours MFU would divide by its A100 fallback.
    peak, _ = peak_flops("neuron", name, titan_peak=312e12)
    assert peak == pytest.approx(tflops * 1e12)


def test_cpu_reports_no_mfu():
    assert peak_flops("cpu", "cpu", titan_peak=312e12)[0] is None


def test_log_line_parses_with_and_without_mfu():
    lines = (
        "step:  3  loss:  7.61039  grad_norm:  2.0994  tps: 4,212  tflops: 0.12  mfu: n/a  memory: 1.27GiB (host RSS)\n"
        "step:  4  loss:  7.1  grad_norm:  2.0  tps: 30,000  tflops: 300.50  mfu: 30.38%  memory: 48.00GiB (CUDA allocator reserved)\n"
    )
    first, second = parse_step_lines(lines)
    assert (first.step, first.tokens_per_second, first.mfu_percent, first.memory_gib) == (3, 4212, None, 1.27)
    assert (second.tflops, second.mfu_percent) == (300.5, 30.38)
