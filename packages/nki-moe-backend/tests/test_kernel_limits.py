"""The SBUF arithmetic behind the kernels' limits (the numbers their docstrings quote)."""

from qwen3_titan_nki_moe import kernel_limits as limits

KiB = 1024


def test_the_budget_is_trn2s_partition_less_what_the_nki_library_keeps():
    assert limits.PARTITIONS * limits.SBUF_PARTITION_BYTES == 28 * 1024 * KiB  # trn2: 28 MiB of SBUF
    assert limits.SBUF_BUDGET == 208 * KiB
    assert limits.PSUM_PARTITION_BYTES == 8 * limits.PSUM_BANK_BYTES == 16 * KiB
    assert limits.MOVING_MAX * 4 == limits.PSUM_BANK_BYTES  # a matmul output fills one bank


def test_rms_norm_fits_hidden_8192_in_fp32():
    assert limits.rms_norm_backward_bytes(8192, 4, 4) == 24 * 8192 + 24 <= limits.SBUF_BUDGET
    assert limits.rms_norm_backward_bytes(16384, 4, 4) > limits.SBUF_PARTITION_BYTES
    assert limits.rms_norm_fits(8192, 4, 4) and not limits.rms_norm_fits(8320, 2, 2)
    # The earlier backward: nine fp32 [128, D] temporaries and an fp32 weight row.
    assert 40 * 8192 > limits.SBUF_PARTITION_BYTES


def test_rope_takes_any_even_head_dim_up_to_8192():
    assert limits.rope_hf_fits(256, 4) and limits.rope_hf_fits(8192, 4)
    assert not limits.rope_hf_fits(8194, 2) and not limits.rope_hf_fits(63, 2)
    assert limits.rope_hf_bytes(128, 16, 2) == 20 * KiB  # 30B-A3B, bf16


def test_grouped_swiglu_at_published_shapes():
    # Qwen3-30B-A3B: hidden 2048, moe_intermediate 768 -> 384 per core at LNC 2.
    assert limits.grouped_swiglu_fits(2048, 384, 4) and limits.grouped_swiglu_fits(2048, 384, 2)
    assert round(limits.grouped_swiglu_forward_bytes(2048, 384, 2) / KiB, 1) == 59.8
    assert round(limits.grouped_swiglu_backward_bytes(2048, 384, 2) / KiB, 1) == 84.3
    assert round(limits.grouped_swiglu_backward_bytes(2048, 384, 4) / KiB, 1) == 159.0
    assert limits.max_grouped_swiglu_hidden(2048, 2) == 1024
    assert limits.max_grouped_swiglu_hidden(2048, 4) == 512
    # Qwen3-235B-A22B: hidden 4096, moe_intermediate 1536 -> 768 per core: too large even in bf16.
    assert round(limits.grouped_swiglu_backward_bytes(4096, 768, 2) / KiB, 1) == 288.5
    assert not limits.grouped_swiglu_fits(4096, 768, 2)
    assert limits.grouped_swiglu_bytes(2048, 384, 2) == limits.grouped_swiglu_backward_bytes(2048, 384, 2)


def test_hbm_offsets_stay_int32():
    # 30B-A3B, LNC 2, 128 experts: 114 688 routed rows fill exactly 2 GiB of fp32 partial sums.
    assert limits.grouped_swiglu_hbm_bytes(114_688, 128, 2048, 768, 2, 2) == limits.MAX_HBM_TENSOR_BYTES
    assert limits.grouped_swiglu_hbm_bytes(65_536, 128, 2048, 768, 2, 2) < limits.MAX_HBM_TENSOR_BYTES


def test_rope_rows_per_partition():
    # 30B-A3B at seq 4096, LNC 2: 16 tiles per program; bf16 head_dim 128 runs 256 B per position.
    assert limits.rope_rows_per_partition(16, 128, 2) == 16  # 4 KiB runs: one transfer per head
    assert limits.rope_rows_per_partition(16, 128, 4) == 16  # 8 KiB
    assert limits.rope_rows_per_partition(48, 128, 4) == 16  # the largest divisor within 8 KiB
    assert limits.rope_rows_per_partition(7, 8192, 4) == 1
