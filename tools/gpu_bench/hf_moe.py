"""Plain transformers baseline: ``Qwen3MoeForCausalLM`` trained by a loop of our own (no torchtitan).

    python -m tools.gpu_bench.hf_moe --results R.jsonl [--tiny] [--phases eager,compile]

The model is the nki-moe row's architecture (Qwen3-30B-A3B's published config.json with 4 layers;
``--tiny``: nki-moe's ``debug_moe``), random init, ``attn_implementation="sdpa"`` and transformers'
default experts implementation. fp32 master weights except the routed experts, which are stored
in bf16 (transformers runs the experts in the weights' dtype: fp32 experts under autocast would
run fp32 GEMMs); bf16 autocast; AdamW (fused where available); labels = inputs (transformers'
shifted causal-LM loss); random tokens. Per phase: warm-up steps, then timed steps between two
synchronisations; peak memory is ``torch.cuda.max_memory_allocated()`` over the phase.

Phases: ``eager``, then ``compile`` (``layer.compile()`` on each decoder layer, torchtitan's
regional compile). FLOPs per token come from ``qwen3_titan_common.perf.flops``, the same
convention as the torchtitan rows. One JSON line per phase is appended to ``--results``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

T0 = time.time()


def log(message: str) -> None:
    print(f"[hf-moe +{time.time() - T0:5.1f}s] {message}", flush=True)


def architecture_config(tiny: bool, layers: int) -> dict:
    if tiny:
        from qwen3_titan_common.assets import DEBUG_MOE_CONFIG

        return dict(DEBUG_MOE_CONFIG)
    from qwen3_titan_common.arch.published import PUBLISHED_CONFIGS

    return {**PUBLISHED_CONFIGS["Qwen3-30B-A3B"], "num_hidden_layers": layers}


def build_model(config: dict, device):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")}
    hf_config = Qwen3MoeConfig(**fields, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(hf_config)
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    for module in experts:
        module.to(torch.bfloat16)
    model.train()
    return model, len(experts)


def make_optimizer(model):
    import torch

    try:
        return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), "AdamW(fused=True)"
    except (RuntimeError, ValueError) as err:
        return torch.optim.AdamW(model.parameters(), lr=1e-4), f"AdamW (fused unavailable: {err})"


def run_phase(model, optimizer, device, args, vocab: int) -> dict:
    import torch

    cuda = device.type == "cuda"
    generator = torch.Generator(device=device).manual_seed(0)
    batches = [
        torch.randint(0, vocab, (args.batch, args.seq), device=device, generator=generator) for _ in range(4)
    ]

    def step(i: int) -> torch.Tensor:
        tokens = batches[i % len(batches)]
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    warmup_s = []
    for i in range(args.warmup):
        start = time.perf_counter()
        loss = step(i)
        sync()
        warmup_s.append(round(time.perf_counter() - start, 2))
        log(f"warm-up step {i + 1}/{args.warmup}: {warmup_s[-1]}s, loss {loss.item():.4f}")
    sync()
    start = time.perf_counter()
    for i in range(args.steps):
        loss = step(args.warmup + i)
    final_loss = loss.item()  # synchronises on CPU too
    sync()
    seconds = time.perf_counter() - start
    result = {
        "tps": args.steps * args.batch * args.seq / seconds,
        "step_ms": 1e3 * seconds / args.steps,
        "warmup_s": warmup_s,
        "final_loss": round(final_loss, 4),
    }
    if cuda:
        result["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        result["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    else:  # the process's peak RSS (Linux: KiB), the CPU counterpart of the step lines' memory
        import resource

        result["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    return result


def main(args) -> int:
    import torch
    import transformers

    want = args.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(want)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, device {name}")
    config = architecture_config(args.tiny, args.layers)
    from qwen3_titan_common.arch.architecture import architecture_from_config
    from qwen3_titan_common.perf.flops import flops_breakdown

    flops = flops_breakdown(architecture_from_config(config, where="hf_moe"), args.seq)
    model, n_experts = build_model(config, device)
    optimizer, optimizer_name = make_optimizer(model)
    common = {
        "model": type(model).__name__,
        "layers": config["num_hidden_layers"],
        "batch": args.batch,
        "seq": args.seq,
        "timed_steps": args.steps,
        "flops_per_token": flops.per_token,
        "matmul_params": flops.matmul_params,
        "params_dtype": f"float32, experts bf16 ({n_experts} modules)",
        "experts_impl": getattr(model.config, "_experts_implementation", None),
        "attn_impl": getattr(model.config, "_attn_implementation", None),
        "optimizer": optimizer_name,
        "autocast": "bf16",
        "device": name,
    }
    log(json.dumps(common))
    rc = 0
    for phase in [p for p in args.phases.split(",") if p]:
        left = args.deadline - time.time()
        record = {"phase": phase, **common}
        if left < args.min_phase_s:
            record.update(status="skipped", error=f"{left:.0f}s left before the deadline")
        else:
            try:
                if phase == "compile":
                    torch._dynamo.reset()
                    for layer in model.model.layers:
                        layer.compile()
                    record["compile"] = "layer.compile() on each decoder layer"
                elif phase != "eager":
                    raise ValueError(f"unknown phase {phase!r}")
                started = time.time()
                record.update(status="ok", **run_phase(model, optimizer, device, args, config["vocab_size"]))
                record["phase_s"] = round(time.time() - started, 1)
            except Exception as err:  # a failed phase is a row, the next phase still runs
                traceback.print_exc()
                record.update(status="error", error=f"{type(err).__name__}: {str(err).strip()[:300]}")
                rc = 1
            finally:
                optimizer.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        log("RESULT " + json.dumps(record))
        with open(args.results, "a") as f:
            f.write(json.dumps(record) + "\n")
    return rc


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", required=True, help="append one JSON line per phase here")
    parser.add_argument("--tiny", action="store_true", help="nki-moe's debug_moe shape (CPU smoke test)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--phases", default="eager,compile")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--deadline", type=float, default=float("inf"), help="unix time")
    parser.add_argument("--min-phase-s", type=float, default=20.0, help="do not start a phase with less left")
    try:
        code = main(parser.parse_args())
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
