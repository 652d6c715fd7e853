"""Benchmark: HF checkpoint load/export against raw safetensors, with peak host memory.

    uv run python tools/bench_hf_io.py [--size-gb 1.0] [--shard-mb 200] [--workdir DIR]

Builds a Qwen3-shaped checkpoint of about --size-gb (fp32) and measures, each in a
fresh process so peak RSS is the method's own:
  export: our streamed, atomic exporter vs safetensors.torch.save_file (one file);
          export-copies hands the exporter a fresh copy of each tensor, as a trainer
          gathering each from its shards does, so the files it holds show in peak RSS;
  load:   our single-process load into torchtitan's Qwen3 vs safetensors.torch.load_file
          of every shard.
Targets (issue 3): ours runs at >= 0.5x the raw speed; peak RSS stays at or below
the process baseline + the model + one shard.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from qwen3_titan_common.perf.precision import describe_cpu

GB = 1000**3
MIB = 1024**2


def _architecture(size_gb: float):
    from qwen3_titan_common.arch.architecture import architecture_from_config

    # ~15.7M parameters per layer at hidden 1024 / ffn 4096, plus a 4096 x 1024 embedding.
    layers = max(1, round((size_gb * GB / 4 - 4096 * 1024) / 15.73e6))
    config = {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024,
        "num_hidden_layers": layers, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64,
        "intermediate_size": 4096, "vocab_size": 4096, "rope_theta": 1e6, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    }  # fmt: skip
    return architecture_from_config(config, "benchmark config")


def _random_state(arch) -> dict[str, torch.Tensor]:
    from qwen3_titan_common.hf.expected_keys import LM_HEAD, expected_hf_shapes

    generator = torch.Generator().manual_seed(0)
    return {
        key: torch.randn(shape, generator=generator) * 0.02
        for key, shape in expected_hf_shapes(arch).items()
        if key != LM_HEAD
    }


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(method: str, workdir: Path, size_gb: float, shard_mb: int) -> dict:
    import qwen3_titan_common.hf.titan_load  # noqa: F401  (imports outside the timed region)
    import qwen3_titan_common.models.qwen3  # noqa: F401

    # huggingface_hub's shard planning imports DTensor on first use (~1 s); a trainer has it already.
    import torch.distributed.tensor  # noqa: F401
    from qwen3_titan_common.hf.export import ExportSpec, export_hf_dir
    from qwen3_titan_common.hf.model_dir import open_model_dir
    from safetensors.torch import load_file, save_file

    baseline = _peak_rss_mib()
    arch = _architecture(size_gb)
    result = {"method": method, "baseline_mib": baseline}
    if method.startswith("export"):
        state = _random_state(arch)
        result["model_mib"] = sum(t.numel() * 4 for t in state.values()) / MIB
        # The model exists before an export starts: measure what the export adds to it.
        result["baseline_mib"] = _peak_rss_mib() - result["model_mib"]
        start = time.perf_counter()
        if method in ("export-ours", "export-copies"):
            spec = ExportSpec(
                out_dir=workdir / "ours", config=dict(arch.source), dtype=torch.float32,
                max_shard_bytes=shard_mb * 1000**2,
            )  # fmt: skip
            if method == "export-ours":
                export_hf_dir(spec, state.items())
            else:
                export_hf_dir(spec, ((key, tensor.clone()) for key, tensor in state.items()))
        else:
            (workdir / "raw").mkdir(exist_ok=True)
            save_file(state, str(workdir / "raw" / "model.safetensors"), metadata={"format": "pt"})
            (workdir / "raw" / "config.json").write_text(json.dumps(dict(arch.source)))
        result["seconds"] = time.perf_counter() - start
    else:
        model_dir = open_model_dir(workdir / "ours")
        result["model_mib"] = model_dir.weight_bytes / MIB
        result["shard_mib"] = max(f.stat().st_size for f in model_dir.weight_files) / MIB
        start = time.perf_counter()
        if method == "load-ours":
            from qwen3_titan_common.hf.titan_load import build_titan_qwen3

            build_titan_qwen3(model_dir, seq_len=16)
        else:
            tensors = {}
            for path in model_dir.weight_files:
                tensors.update(load_file(str(path)))
            # load_file maps the file lazily: touch every byte so both sides read it all.
            for tensor in tensors.values():
                tensor.sum()
        result["seconds"] = time.perf_counter() - start
    result["peak_rss_mib"] = _peak_rss_mib()
    return result


def _run_child(method: str, args) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", method, "--workdir", str(args.workdir),
         "--size-gb", str(args.size_gb), "--shard-mb", str(args.shard_mb)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--shard-mb", type=int, default=200)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", default=None)
    args = parser.parse_args()
    print(describe_cpu(), flush=True)  # figures from other CPUs are not comparable as they are
    if args.child:
        print(json.dumps(child(args.child, args.workdir, args.size_gb, args.shard_mb)))
        return 0
    owned = args.workdir is None
    args.workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_hf_io_"))
    try:
        rows = {}
        for method in ("export-ours", "export-copies", "export-raw", "load-ours", "load-raw"):
            runs = [_run_child(method, args) for _ in range(args.repeats)]
            runs.sort(key=lambda r: r["seconds"])
            rows[method] = {**runs[len(runs) // 2], "min_s": runs[0]["seconds"], "max_s": runs[-1]["seconds"]}
        size_mib = rows["load-ours"]["model_mib"]
        shard_mib = rows["load-ours"]["shard_mib"]
        print(
            f"checkpoint: {size_mib:.0f} MiB fp32, shards of at most {shard_mib:.0f} MiB; medians of {args.repeats}"
        )
        print(f"{'method':<12} {'seconds (min-max)':>20} {'MiB/s':>8} {'peak RSS':>9} {'over baseline':>14}")
        for method, r in rows.items():
            over = r["peak_rss_mib"] - r["baseline_mib"]
            spread = f"{r['seconds']:.2f} ({r['min_s']:.2f}-{r['max_s']:.2f})"
            print(
                f"{method:<12} {spread:>20} {size_mib / r['seconds']:>8.0f} {r['peak_rss_mib']:>8.0f}M {over:>13.0f}M"
            )
        for kind in ("export", "load"):
            ratio = rows[f"{kind}-raw"]["seconds"] / rows[f"{kind}-ours"]["seconds"]
            verdict = "met" if ratio >= 0.5 else "MISSED"
            print(f"{kind} speed: ours = {ratio:.2f}x raw safetensors (target >= 0.50x): {verdict}")
        for method in ("export-ours", "export-copies", "load-ours"):
            r = rows[method]
            bound = size_mib + shard_mib
            over = r["peak_rss_mib"] - r["baseline_mib"]
            verdict = "met" if over <= bound * 1.05 else "MISSED"
            print(
                f"{method} memory: {over:.0f} MiB over baseline; model + one shard = {bound:.0f} MiB: {verdict}"
            )
    finally:
        if owned:
            shutil.rmtree(args.workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
