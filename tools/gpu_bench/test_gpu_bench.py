"""Checks of the GPU benchmark's logic that need no GPU (and no torchtitan run).

    uv run --no-sync pytest tools/gpu_bench/test_gpu_bench.py

The end-to-end check is ``python -m tools.gpu_bench.bench --tiny`` (README.md); this covers what the tiny
run cannot reach on a CPU: CUDA-shaped logs, the CUDA-graph retry, target verdicts, and the shims.
"""

from __future__ import annotations

import json

import pytest

from tools.gpu_bench import bench, trace_summary
from tools.gpu_bench.anchors import flops_check
from tools.gpu_bench.compat import gpu_bench_shims as shims
from tools.gpu_bench.plan import Mode
from tools.gpu_bench.report import target_verdict, targets_summary
from tools.gpu_bench.row import Row, finish_row
from tools.gpu_bench.titan_rows import parse_titan_run

FULL = Mode.make(tiny=False, steps=None, device=None)


def _step(n: int, tps: int, mem: float = 56.4) -> str:
    return (
        f"[titan] 2026-12-01 10:00:{n:02d},000 - root - INFO - \x1b[31mstep: {n:2}  \x1b[32mloss: 9.1234  "
        f"grad_norm:  1.2345  tps: {tps:,}  tflops: {13.141278720 * tps / 1000:,.2f}  "
        f"mfu: {100 * 13.141278720e9 * tps / 989e12:.2f}%  memory: {mem:.2f}GiB (CUDA allocator reserved)\x1b[39m"
    )


def _log(first_line: str, tps: list[int], extra: str = "") -> str:
    lines = [
        first_line,
        "[gpu-bench compat] torch 2.11.0+cu130: applied torch.distributed.set_timeout, "
        "torch.distributed.fsdp.DataParallelMeshDims",
        "[titan] ... - root - INFO - [metrics] 13.141 GFLOP per token: 6 x 1,720,451,072 matmul parameters "
        "+ 2,818,572,288 attention (not halved); 1,720,574,976 parameters in all",
        "[titan] ... - root - INFO - Compiling each TransformerBlock with torch.compile",
        "[titan] ... - root - INFO - Training starts at step 1",
    ]
    lines += [_step(i + 1, t) for i, t in enumerate(tps)]
    return "\n".join(lines) + "\n" + extra


def test_flops_check_explains_the_anchor_difference():
    checks = {c["model"]: c for c in flops_check(4096)}
    assert checks["1.7B"]["ours"] == 13_141_278_720
    assert checks["30B-A3B x4"]["ours"] == 4_037_541_888
    for c in checks.values():
        assert c["difference"] > 0 and "RMSNorm" in c["explanation"], c


def test_parse_cuda_run_takes_the_harmonic_mean_after_warmup():
    # steps 1-2 compile and capture, 6-14 are steady, 15-17 run under the profiler, 18 pays for its write
    tps = [722, 18_019] + [36_000, 36_400, 36_800] * 4 + [36_500, 30_000, 30_100, 20_000]
    row = Row("native-compile", "native-backend", "native compile", "1.7B")
    status = {
        "ok": True,
        "stage": "train",
        "peak_allocated_gib": 47.9,
        "shims": ["torch.distributed.set_timeout"],
    }
    parse_titan_run(row, _log("$ tt_run.py -- --compile.enable", tps), status, FULL)
    steady = tps[5:14]
    assert row.steady_steps == "6-14"
    assert row.tps == pytest.approx(len(steady) / sum(1 / t for t in steady))
    assert row.flops_per_token == 13_141_278_720
    assert row.first_step_s == pytest.approx(2 * 4096 / 722, abs=0.01)
    assert row.peak_allocated_gib == 47.9 and row.logged_memory_gib == 56.4
    assert row.cuda_graphs == "on" and row.extra["compile"] == "per-block torch.compile"
    assert row.shims == ["torch.distributed.fsdp.DataParallelMeshDims", "torch.distributed.set_timeout"]
    finish_row(row, 989e12)
    assert row.mfu_pct == pytest.approx(row.trainer_mfu_pct, rel=1e-3)


def test_targets_say_by_how_much_they_are_missed():
    row = Row("native-compile", "native-backend", "native compile", "1.7B", status="ok", tps=36_372.0)
    row.flops_per_token, row.peak_allocated_gib = 13_141_278_720, 50.0
    finish_row(row, 989e12)
    assert target_verdict(row) == "MFU -6.7pp, mem +1.9GiB"
    lines, records = targets_summary([row])
    assert "MISSED by 6.67 pp" in lines[1] and "MISSED by 1.85 GiB" in lines[1]
    assert records[0]["mfu_verdict"] == "missed by 6.67 pp"
    assert records[1]["verdict"] == "not measured"


def test_cuda_graph_failure_in_training_is_retried_once(monkeypatch, tmp_path, capsys):
    calls = []

    def fake_titan(part, mode, python, env, work, logs, clock, suffix="", no_cuda_graphs=False):
        calls.append((part.id + suffix, no_cuda_graphs))
        row = Row(
            part.id + suffix, part.backend, part.label + (" no-cudagraph" if suffix else ""), part.model
        )
        row.anchor, row.seconds = part.anchor, 40.0
        if part.backend == "hf-v5-backend" and not no_cuda_graphs:
            row.status, row.cuda_graphs, row.extra = "error", "on", {"stage": "train"}
            row.note = "RuntimeError: operation not permitted when stream is capturing"
        else:
            row.status, row.tps, row.cuda_graphs = "ok", 40_000.0, "off" if no_cuda_graphs else "on"
            row.flops_per_token, row.peak_allocated_gib, row.steady_steps = 13_141_278_720, 47.0, "6-14"
            if part.model != "1.7B":
                row.flops_per_token = 4_037_541_888
        return row

    def fake_hf(part, mode, python, env, work, logs, clock):
        return [Row(f"hf_moe-{p}", part.backend, f"{part.label} {p}", part.model, status="ok", tps=80_000.0)
                for p in ("eager", "compile")]  # fmt: skip

    info = {
        "device": "NVIDIA H200",
        "device_kind": "cuda",
        "titan_peak_flops": 989e12,  # what env_probe reads from torchtitan's table on an H200
        "versions": {"torch": "2.11.0+cu130"},
        "imports": {},
    }
    monkeypatch.setattr(bench, "run_titan_part", fake_titan)
    monkeypatch.setattr(bench, "run_hf_part", fake_hf)
    monkeypatch.setattr(bench, "probe_env", lambda *a: info)
    monkeypatch.setattr(bench, "install_wheels", lambda *a: ([], "none"))
    rc = bench.main(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")])
    assert rc == 1  # the failed first try stays in the report
    assert calls == [
        ("native-compile", False),
        ("hf_v5-compile", False),
        ("hf_v5-compile-nocg", True),
        ("nki_moe-eager", False),
        ("nki_moe-compile", False),
        ("native-eager", False),
        ("hf_v5-eager", True),  # later runs of that backend keep CUDA graphs off
        ("native-compile-noreshard", False),
        ("hf_v5-compile-noreshard", True),
        ("nki_moe-compile-noreshard", False),
    ]
    result = json.loads((tmp_path / "out" / "gpu_bench.json").read_text())
    labels = [r["label"] for r in result["rows"]]
    assert "hf-v5 compile no-cudagraph" in labels and "hf-v5 eager no-cudagraph" in labels
    out = capsys.readouterr().out
    assert "native-backend   best: native compile: MFU 53.15% < 55%: MISSED by 1.85 pp" in out
    assert "memory 47.00 <= 48.15 GiB: MET" in out


def test_shims_patch_only_what_is_missing(monkeypatch):
    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp

    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    monkeypatch.setattr(shims, "_state", {"done": False})
    monkeypatch.setattr(shims, "APPLIED", [])
    monkeypatch.delenv("GPU_BENCH_NO_SHIMS", raising=False)
    for module, name in ((dist, "set_timeout"), (fsdp, "DataParallelMeshDims")):
        if hasattr(module, name):
            monkeypatch.delattr(module, name)
    assert shims.missing() == ["torch.distributed.set_timeout", "torch.distributed.fsdp.DataParallelMeshDims"]
    applied = shims.apply(quiet=True)
    assert applied == ["torch.distributed.set_timeout", "torch.distributed.fsdp.DataParallelMeshDims"]
    assert shims.missing() == []
    dims = fsdp.DataParallelMeshDims(shard="fsdp", replicate=("a", "b"))
    assert dims.shard_names == ("fsdp",) and dims.replicate_names == ("a", "b")
    with pytest.raises(ValueError):
        fsdp.DataParallelMeshDims()
    monkeypatch.setattr(shims, "_state", {"done": False})
    monkeypatch.setattr(shims, "APPLIED", [])
    assert shims.apply(quiet=True) == []  # nothing missing any more: nothing patched


def test_trace_summary_sorts_kernels_and_measures_idle_time():
    step = {"ph": "X", "cat": "user_annotation"}
    events = [
        {**step, "name": "ProfilerStep#15", "ts": 0, "dur": 100_000},
        {**step, "name": "ProfilerStep#16", "ts": 100_000, "dur": 100_000},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 10, "dur": 5},
        # the same steps again on another host thread and on the device's timeline: counted once
        {**step, "name": "ProfilerStep#15", "ts": 5, "dur": 90_000},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#16", "ts": 100_000, "dur": 150_000},
    ]
    kernels = [
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN", 0, 60_000),
        ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", 60_000, 20_000),
        ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", 80_000, 5_000),
        (
            "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>",
            110_000,
            40_000,
        ),
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN", 150_000, 30_000),
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN", 170_000, 10_000),  # overlaps the previous one
    ]
    events += [{"ph": "X", "cat": "kernel", "name": n, "ts": t, "dur": d} for n, t, d in kernels]
    summary = trace_summary.summarise(events)
    assert summary.steps == [16, 17]
    assert summary.wall_ms_per_step == 100.0
    assert summary.kernel_ms_per_step == 82.5 and summary.busy_ms_per_step == 77.5
    assert summary.by_category_ms == {
        "GEMM": 50.0, "optimizer (AdamW)": 20.0, "attention": 10.0, "compiled (triton)": 2.5,
    }  # fmt: skip
    assert summary.top_kernels[0] == ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN", 50.0, 1.5)
    table = "\n".join(trace_summary.markdown("native compile", summary))
    assert "| device idle | 22.50 | 22.5 |" in table


def test_trace_categories_of_real_kernel_names():
    expect = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1": "GEMM",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3": "attention",
        "void cutlass::device_kernel<at::cuda::detail::GroupProblemShape>": "grouped GEMM (experts)",
        "void at::native::vectorized_elementwise_kernel<4, at::native::bfloat16_copy_kernel_cuda>": "copies and casts",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>": "cross-entropy / softmax (eager)",
        "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL": "NCCL",
        "triton_poi_fused_silu_mul_3": "compiled (triton)",
        "something_new": "other",
    }
    for name, label in expect.items():
        assert trace_summary.category(name) == label, name
