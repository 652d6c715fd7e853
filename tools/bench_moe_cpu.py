"""Training throughput of the nki-moe backend's reference MoE path against transformers' eager Qwen3-MoE.

    uv run python tools/bench_moe_cpu.py                 # CPU, both shapes below, batch 8 x seq 256
    uv run python tools/bench_moe_cpu.py --shape debug_moe --steps 10 --batch 4
    uv run python tools/bench_moe_cpu.py --device cuda   # adds grouped GEMM vs per-expert loop (bf16)

Shapes (``--shape``, default both; ``--experts/--top-k/--moe-intermediate`` vary either):

``debug_moe``      the backend's default model: 8 experts, top-2, expert width 256;
``debug_moe_64e``  the same trunk with the experts of torchtitan's ``debugmodel_moe``: 64 experts,
                   top-8, expert width 768 (Qwen3-30B-A3B has 128 experts, top-8, width 768).

Both sides train the same architecture (the shape's config.json) with the same plain loop
(forward, cross-entropy, backward, torch's fused AdamW step: the implementation torchtitan's
default optimizer config picks) on the same tokens: ours is torchtitan's Qwen3-MoE with the kernel
registry's overrides (reference kernels), theirs ``Qwen3MoeForCausalLM`` with
``attn_implementation="eager"`` and ``experts_implementation="eager"``.
Each is timed in two precisions:

``fp32``        fp32 weights and compute;
``bf16-mixed``  fp32 master weights and AdamW, bf16 compute copy (what the backend's trainer runs
                on CPU: FSDP2's mixed precision casts parameters to bf16 for compute).

The headline compares ours as the backend trains it (bf16-mixed) with transformers' eager
training loop as written (fp32); the same-precision ratios are printed too. The MoE layer alone
(router + experts, forward and backward) is timed the same way. For reference (no target) both
are also timed against transformers' ``experts_implementation="grouped_mm"``. Steps alternate
between the sides so that load from other processes hits both alike; each figure is the median
step (``--clock cpu`` times this process's CPU time instead of elapsed time, for shared machines).
Not a test: it prints the figures and the ratio next to the target (>= 3x).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from qwen3_titan_common.perf.precision import describe_cpu

TARGET = 3.0

# Expert layouts on debug_moe's trunk, as changes to its config.json.
SHAPES = {
    "debug_moe": {},
    # torchtitan's debugmodel_moe experts
    "debug_moe_64e": {"num_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": 768},
}


def _arch_config(args, shape: str = "debug_moe"):
    from qwen3_titan_common.assets import DEBUG_MOE_CONFIG

    config = {**DEBUG_MOE_CONFIG, **SHAPES[shape], "num_hidden_layers": args.layers}
    for key, value in (
        ("num_experts", args.experts),
        ("num_experts_per_tok", args.top_k),
        ("moe_intermediate_size", args.moe_intermediate),
    ):
        if value is not None:
            config[key] = value
    return config


def titan_model(config: dict, device, dtype):
    from qwen3_titan_common.arch.architecture import architecture_from_config
    from qwen3_titan_common.models.qwen3 import titan_qwen3_model_config
    from qwen3_titan_nki_moe.overrides import KERNEL_OVERRIDES
    from torchtitan.config.override import OverrideConfig, apply_overrides

    model_config = titan_qwen3_model_config(architecture_from_config(config, "bench"))
    # The reference kernels whatever the machine: the benchmark measures them.
    imports = [(name, {"kernels": "reference"}) for name in KERNEL_OVERRIDES]
    apply_overrides(OverrideConfig(imports=imports), model_config)
    with torch.device(device):
        model = model_config.build()
        model.init_states()
    return model.to(dtype)


def hf_config(config: dict, experts: str, **settings):
    """transformers' Qwen3MoeConfig for the shape's config.json, with these experts and settings."""
    from transformers import Qwen3MoeConfig

    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")}
    return Qwen3MoeConfig(**fields, experts_implementation=experts, **settings)


def hf_model(config: dict, device, dtype, experts: str = "eager"):
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(hf_config(config, experts, attn_implementation="eager")).to(device, dtype)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


class Stepper:
    """One training step of ``model``: fp32, or bf16 compute over fp32 master weights."""

    def __init__(self, model, precision: str, hf: bool):
        self.hf = hf
        self.master = model.float()
        if precision == "bf16-mixed":
            self.compute = copy.deepcopy(model).to(torch.bfloat16)
        else:
            self.compute = self.master
        self.optimizer = torch.optim.AdamW(self.master.parameters(), lr=1e-3, fused=True)

    def __call__(self, tokens) -> float:
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        logits = self.compute(input_ids=inputs).logits if self.hf else self.compute(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        if self.compute is not self.master:
            for m, c in zip(self.master.parameters(), self.compute.parameters(), strict=True):
                m.grad = None if c.grad is None else c.grad.float()
                c.grad = None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.compute is not self.master:
            with torch.no_grad():
                for m, c in zip(self.master.parameters(), self.compute.parameters(), strict=True):
                    c.copy_(m)
        return loss.item()


def moe_step(layer, x):
    out = layer(x)
    out = out[0] if isinstance(out, tuple) else out
    out.float().square().mean().backward()
    layer.zero_grad(set_to_none=True)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]


def timed_pair(step_a, step_b, steps: int, warmup: int, device) -> tuple[list[float], list[float]]:
    times_a, times_b = [], []
    for i in range(warmup + steps):
        for step, times in ((step_a, times_a), (step_b, times_b)):
            _sync(device)
            start = clock()
            step()
            _sync(device)
            if i >= warmup:
                times.append(clock() - start)
    return times_a, times_b


def _tokens_per_s(tokens: int, times: list[float]) -> float:
    return tokens / statistics.median(times)


def full_model(args, config, device, ours_precision: str, theirs_precision: str, experts: str = "eager"):
    ours = Stepper(titan_model(config, device, torch.float32), ours_precision, hf=False)
    theirs = Stepper(hf_model(config, device, torch.float32, experts), theirs_precision, hf=True)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config["vocab_size"], (args.batch, args.seq + 1), generator=g).to(device)
    t_ours, t_theirs = timed_pair(
        lambda: ours(tokens), lambda: theirs(tokens), args.steps, args.warmup, device
    )
    n = args.batch * args.seq
    return _tokens_per_s(n, t_ours), _tokens_per_s(n, t_theirs)


def moe_layers(args, config, device, dtype, experts: str = "eager"):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    ours = titan_model({**config, "num_hidden_layers": 1}, device, dtype).layers["0"].moe
    torch.manual_seed(0)
    theirs = Qwen3MoeSparseMoeBlock(hf_config(config, experts)).to(device, dtype)
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.02)
    g = torch.Generator().manual_seed(1)
    x = (
        torch.randn(args.batch, args.seq, config["hidden_size"], generator=g)
        .to(device, dtype)
        .requires_grad_()
    )
    t_ours, t_theirs = timed_pair(
        lambda: moe_step(ours, x), lambda: moe_step(theirs, x), args.steps, args.warmup, device
    )
    n = args.batch * args.seq
    return _tokens_per_s(n, t_ours), _tokens_per_s(n, t_theirs)


@contextlib.contextmanager
def per_expert_loop():
    """Force the reference's per-expert loop instead of torch._grouped_mm."""
    from qwen3_titan_nki_moe.ops import grouped_swiglu as ops

    real = ops._use_grouped_mm
    ops._use_grouped_mm = lambda *tensors: False
    try:
        yield
    finally:
        ops._use_grouped_mm = real


def gemm_comparison(args, config, device):
    """bf16 MoE layer and model: torch._grouped_mm against the per-expert loop (same reference op)."""
    dtype = torch.bfloat16
    layer = titan_model({**config, "num_hidden_layers": 1}, device, dtype).layers["0"].moe
    x = torch.randn(
        args.batch, args.seq, config["hidden_size"], device=device, dtype=dtype, requires_grad=True
    )
    stepper = Stepper(titan_model(config, device, torch.float32), "bf16-mixed", hf=False)
    tokens = torch.randint(0, config["vocab_size"], (args.batch, args.seq + 1), device=device)

    def run(fn):
        times, _ = timed_pair(fn, lambda: None, args.steps, args.warmup, device)
        return _tokens_per_s(args.batch * args.seq, times)

    results = {}
    for name, ctx in (("torch._grouped_mm", contextlib.nullcontext), ("per-expert loop", per_expert_loop)):
        with ctx():
            results[name] = (
                run(lambda: moe_step(layer, x)),
                run(lambda: stepper(tokens)),
            )
    return results


def run_shape(args, shape: str, device) -> None:
    config = _arch_config(args, shape)
    varied = (args.experts, args.top_k, args.moe_intermediate) != (None,) * 3
    print(
        f"\nshape: {shape}{' variant' if varied else ''} (hidden {config['hidden_size']}, "
        f"{config['num_hidden_layers']} layers, {config['num_experts']} experts top-"
        f"{config['num_experts_per_tok']}, moe_intermediate {config['moe_intermediate_size']}, vocab "
        f"{config['vocab_size']}), batch {args.batch} x seq {args.seq}, {args.steps} timed steps after "
        f"{args.warmup}, {torch.get_num_threads()} threads, device {device}, {args.clock} clock",
        flush=True,
    )
    rows = [
        ("bf16-mixed", "fp32", "eager", "headline: ours as trained vs transformers' loop as written"),
        ("fp32", "fp32", "eager", "same precision"),
        ("bf16-mixed", "bf16-mixed", "eager", "same precision"),
        ("bf16-mixed", "bf16-mixed", "grouped_mm", "reference only: transformers' grouped_mm experts"),
    ]
    for ours_p, theirs_p, experts, what in rows:
        ours, theirs = full_model(args, config, device, ours_p, theirs_p, experts)
        ratio = ours / theirs
        target = (
            f"   [{shape}] target >= {TARGET:.0f}x: {'met' if ratio >= TARGET else 'MISSED'}"
            if what.startswith("headline")
            else ""
        )
        print(
            f"training tokens/s  nki-moe reference {ours_p:10s} {ours:7.0f}  transformers {experts:10s} "
            f"{theirs_p:10s} {theirs:7.0f}  ratio {ratio:5.2f}x  ({what}){target}",
            flush=True,
        )
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for experts in ("eager", "grouped_mm"):
            ours, theirs = moe_layers(args, config, device, dtype, experts)
            print(
                f"MoE layer tokens/s nki-moe reference {precision:10s} {ours:7.0f}  transformers {experts:10s} "
                f"{precision:10s} {theirs:7.0f}  ratio {ours / theirs:5.2f}x  (router + experts, forward + backward)",
                flush=True,
            )
    if device.type == "cuda":
        for name, (layer_tps, model_tps) in gemm_comparison(args, config, device).items():
            print(
                f"cuda bf16, {name:17s}: MoE layer {layer_tps:9.0f} tokens/s, training {model_tps:9.0f} tokens/s"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--shape", action="append", choices=sorted(SHAPES), default=None, help="default: every shape"
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=None, help="num_experts (overrides the shape's)")
    parser.add_argument("--top-k", type=int, default=None, help="num_experts_per_tok (overrides the shape's)")
    parser.add_argument(
        "--moe-intermediate", type=int, default=None, help="moe_intermediate_size (overrides the shape's)"
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall: elapsed time (default); cpu: this process's CPU time, steadier on a shared machine "
        "(with --threads 1 it equals elapsed time on an idle one)",
    )
    args = parser.parse_args()
    print(describe_cpu(), flush=True)  # figures from other CPUs are not comparable as they are
    global clock
    clock = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False")

    for shape in args.shape or list(SHAPES):
        run_shape(args, shape, device)


if __name__ == "__main__":
    main()
