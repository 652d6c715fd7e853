"""Experiment: a Qwen3-MoE fine-tuned on one repeated record, with and without the router balance loss.

    uv run python -m tools.moe_balance_narrow [--steps 40] [--coefs 0.001,0.01,0.1] [--json out.json]

Narrow data is where routing collapses: every token of every row is one record's, so the router sees a
few dozen distinct contexts and nothing pulls it back from sending them to the same experts. The model: a
Qwen3-MoE of 8 experts, top 2 (hidden 64, 2 layers, the embedded tokenizer's 4,096 tokens), written by
transformers' ``save_pretrained`` with seed 0; the data: one chat record, repeated 256 times. Each run
starts from the same checkpoint, trains the same rows in the same order (native backend, fp32, CPU, seed
0, default learning rate), and differs only in ``--moe.router_aux_loss`` (off, then on at each
coefficient). The figure is the experts' load the step line reports (``perf.expert_load``), read from
TensorBoard: per layer, the share of its tokens the busiest expert took over the last logging interval
(balanced: 2/8 = 25%), and the experts that took none. ~1 minute per run on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from qwen3_titan_testing.narrow_moe import RECORD, make_checkpoint, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--coefs", default="0.001,0.01,0.1")
    parser.add_argument("--json", type=Path)
    options = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_checkpoint(root / "moe")
        data = root / "narrow.jsonl"
        data.write_text("".join(json.dumps(RECORD) + "\n" for _ in range(256)))
        for coef in [None, *(float(c) for c in options.coefs.split(","))]:
            name = "off" if coef is None else f"on, coef {coef:g}"
            loads = run(model, data, root / name.replace(" ", "").replace(",", "_"), options.steps, coef)
            results[name] = loads
            layers = sorted(k for k in loads if k != "run")
            shares = "  ".join(
                f"layer {k}: {100 * loads[k]['busiest_share']:.0f}% busiest, {loads[k]['idle_experts']:.0f} idle"
                for k in layers
            )
            print(f"{name:>15}  loss {loads['run']['global_avg_loss']:.4f}  {shares}", flush=True)
    if options.json:
        options.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
