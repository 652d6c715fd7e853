"""What runs: the parts in priority order, each with its time cap, and the run's shape (full or tiny)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Part:
    id: str
    backend: str  # package name, or "transformers"
    label: str
    model: str  # "1.7B" | "30B-A3B x4"
    config: str  # torchtitan --config (hf part: unused)
    tiny_config: str
    flags: tuple[str, ...]
    cap_s: int
    min_s: int
    anchor: str
    module: str = ""  # torchtitan --module; "" = the transformers loop


NO_RESHARD = ("--parallelism.fsdp_reshard_after_forward", "never")
PARTS = (
    Part("native-compile", "native-backend", "native compile", "1.7B", "qwen3_1_7b", "debug",
         ("--compile.enable",), 110, 50, "B compile", "qwen3_titan_native"),
    Part("hf_v5-compile", "hf-v5-backend", "hf-v5 compile", "1.7B", "qwen3_1_7b", "debug",
         ("--compile.enable",), 110, 50, "A compile-regional", "qwen3_titan_hf_v5"),
    Part("nki_moe-eager", "nki-moe-backend", "nki-moe ref eager", "30B-A3B x4", "qwen3_30b_a3b_4layers",
         "debug_moe", ("--kernels", "reference"), 80, 40, "D eager", "qwen3_titan_nki_moe"),
    Part("hf_moe", "transformers", "transformers MoE", "30B-A3B x4", "", "", (), 80, 30,
         "C eager-bf16experts"),
    Part("nki_moe-compile", "nki-moe-backend", "nki-moe ref compile", "30B-A3B x4", "qwen3_30b_a3b_4layers",
         "debug_moe", ("--kernels", "reference", "--compile.enable"), 90, 50, "D compile", "qwen3_titan_nki_moe"),
    Part("native-eager", "native-backend", "native eager", "1.7B", "qwen3_1_7b", "debug", (), 70, 35,
         "B eager", "qwen3_titan_native"),
    Part("hf_v5-eager", "hf-v5-backend", "hf-v5 eager", "1.7B", "qwen3_1_7b", "debug", (), 70, 35,
         "A eager", "qwen3_titan_hf_v5"),
    # Variants, run when time is left: one rank needs no resharding after forward (the backward then
    # skips a second fp32 -> bf16 copy of every weight, for the bf16 weights' memory).
    Part("native-compile-noreshard", "native-backend", "native compile, no reshard", "1.7B", "qwen3_1_7b",
         "debug", ("--compile.enable", *NO_RESHARD), 80, 50, "B compile", "qwen3_titan_native"),
    Part("hf_v5-compile-noreshard", "hf-v5-backend", "hf-v5 compile, no reshard", "1.7B", "qwen3_1_7b",
         "debug", ("--compile.enable", *NO_RESHARD), 80, 50, "A compile-regional", "qwen3_titan_hf_v5"),
    Part("nki_moe-compile-noreshard", "nki-moe-backend", "nki-moe ref compile, no reshard", "30B-A3B x4",
         "qwen3_30b_a3b_4layers", "debug_moe", ("--kernels", "reference", "--compile.enable", *NO_RESHARD),
         90, 50, "D compile", "qwen3_titan_nki_moe"),
)  # fmt: skip


# Each backend's config registry: the env probe imports them before any run (saves failed runs).
REGISTRIES = {
    "native-backend": "qwen3_titan_native.config_registry",
    "hf-v5-backend": "qwen3_titan_hf_v5.config_registry",
    "nki-moe-backend": "qwen3_titan_nki_moe.config_registry",
}


@dataclass
class Mode:
    tiny: bool
    batch: int
    seq: int
    steps: int
    warmup_steps: int  # step lines before the steady ones
    steady_last: int  # the last steady step; the profiled steps come after it
    hf_warmup: int
    hf_steps: int
    cap_scale: float
    device: str  # "cuda" | "cpu"

    @classmethod
    def make(cls, tiny: bool, steps: int | None, device: str | None) -> Mode:
        if tiny:
            steps = steps or 6
            return cls(True, 2, 128, steps, 2, steps - 2, 1, 3, 4.0, device or "cpu")
        steps = steps or 18
        return cls(False, 2, 4096, steps, 5, steps - 4, 3, 10, 1.0, device or "cuda")

    @property
    def profile_freq(self) -> int:
        """torchtitan's profiler schedule (wait, 1 warm-up, 2 active): warm-up on step ``steps - 3``, trace
        steps ``steps - 2`` and ``steps - 1`` (written after the latter); the last step pays for the write."""
        return self.steps - 1


def select_parts(opts) -> list[Part]:
    known = {p.id for p in PARTS}
    only = {x for x in opts.only.split(",") if x}
    skip = {x for x in opts.skip.split(",") if x}
    unknown = (only | skip) - known
    if unknown:
        raise SystemExit(
            f"gpu-bench: unknown part(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}"
        )
    if opts.only:  # in the order given: the first ones get the time
        by_id = {p.id: p for p in PARTS}
        return [by_id[x] for x in dict.fromkeys(opts.only.split(",")) if x and x not in skip]
    return [p for p in PARTS if p.id not in skip]
