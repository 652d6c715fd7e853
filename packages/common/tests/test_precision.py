"""The default compute precision: bf16 where the CPU has bf16 matrix instructions torch uses, fp32 elsewhere."""

import pytest
from qwen3_titan_common.perf.precision import (
    ComputePrecision,
    cpu_compute_precision,
    cpu_flags,
    default_compute_precision,
    describe_cpu,
    precision_line,
)

# Flags as /proc/cpuinfo lists them on three kinds of machine.
ZEN3_AVX2 = frozenset("fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi2".split())
ZEN4_AVX512_BF16 = ZEN3_AVX2 | {"avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN4_AVX512_BF16 | {"amx_bf16", "amx_tile", "amx_int8"}
GRAVITON3 = frozenset("fp asimd sve bf16 i8mm".split())


def test_a_cpu_without_bf16_matrix_instructions_computes_in_fp32():
    chosen = cpu_compute_precision(ZEN3_AVX2, "x86_64", env={})
    assert chosen == ComputePrecision("float32", "this CPU has no bf16 matrix instructions")


@pytest.mark.parametrize(
    "flags, named", [(ZEN4_AVX512_BF16, "AVX512-BF16"), (SAPPHIRE_RAPIDS, "AMX-BF16 and AVX512-BF16")]
)
def test_a_cpu_with_bf16_matrix_instructions_computes_in_bf16(flags, named):
    chosen = cpu_compute_precision(flags, "x86_64", env={})
    assert chosen == ComputePrecision("bfloat16", f"this CPU has {named}")


@pytest.mark.parametrize("cap, dtype", [("AVX2", "float32"), ("avx512_core", "float32"), ("AVX512_CORE_BF16", "bfloat16"), ("ALL", "bfloat16")])  # fmt: skip
def test_onednn_isa_cap_below_bf16_counts_as_no_bf16(cap, dtype):
    chosen = cpu_compute_precision(ZEN4_AVX512_BF16, "x86_64", env={"ONEDNN_MAX_CPU_ISA": cap})
    assert chosen.dtype == dtype
    if dtype == "float32":
        assert f"ONEDNN_MAX_CPU_ISA={cap}" in chosen.reason


def test_aarch64_is_fp32_until_measured():
    chosen = cpu_compute_precision(GRAVITON3, "aarch64", env={})
    assert chosen.dtype == "float32" and "aarch64" in chosen.reason


def test_accelerators_keep_torchtitans_bf16():
    for kind in ("cuda", "neuron"):
        assert default_compute_precision(kind).dtype == "bfloat16"


def test_cpuinfo_flags_are_read_for_x86_and_aarch64(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\n"
    )
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\nCPU implementer\t: 0x41\n")
    assert cpu_flags(x86) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(arm) == {"fp", "asimd", "bf16"}
    assert cpu_flags(tmp_path / "absent") == frozenset()  # macOS: no /proc/cpuinfo


def test_the_line_states_the_default_or_what_a_slow_choice_costs():
    no_bf16 = ComputePrecision("float32", "this CPU has no bf16 matrix instructions")
    assert (
        precision_line("float32", "cpu", no_bf16) == "fp32 compute (this CPU has no bf16 matrix instructions)"
    )
    asked = precision_line("bfloat16", "cpu", no_bf16)
    assert asked.startswith(
        "bf16 compute, fp32 master weights as asked (--training.mixed_precision_param bfloat16)"
    )
    assert "this CPU has no bf16 matrix instructions: a bf16 matrix product measures" in asked
    assert "x slower than fp32 here" in asked
    with_bf16 = ComputePrecision("bfloat16", "this CPU has AVX512-BF16")
    assert precision_line("float32", "cpu", with_bf16) == (
        "fp32 compute as asked (--training.mixed_precision_param float32); "
        "the default here is bf16 (this CPU has AVX512-BF16)"
    )


def test_benchmarks_name_the_instruction_set():
    line = describe_cpu(ZEN4_AVX512_BF16, "x86_64", env={})
    assert "x86_64" in line and "AVX2, AVX512F, AVX512-VNNI, FMA" in line
    assert "bf16 matrix: AVX512-BF16" in line and "default compute bf16" in line
    assert "bf16 matrix: none" in describe_cpu(ZEN3_AVX2, "x86_64", env={})
