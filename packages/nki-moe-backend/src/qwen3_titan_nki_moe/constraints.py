"""The NKI kernels' shape rules, checked before anything is built.

Each kernel tiles its work in 128-row partitions and splits it over the ``LNC`` physical
cores of a logical NeuronCore (grid ``(lnc,)``), so a run that asks for the NKI path
(``--kernels nki``) is checked here on every device, a laptop included, and fails with one line naming the flag (or ``config.json`` field) and the
nearest valid value. Under ``--kernels auto`` on Trainium an op whose rule fails falls
back to its reference implementation instead, with the rule as the logged reason.

The rules, by op (P = 128 partitions, LNC = ``NEURON_LOGICAL_NC_CONFIG``, 2 on trn2):

- ``rope_hf``:        seq_len a multiple of P x LNC; seq_len <= the RoPE cache length;
                      head_dim even and <= 8192 (head_dim is on the free axis)
- ``rms_norm``:       seq_len a multiple of P x LNC (rows split over the cores);
                      hidden_size <= 8192 (one row per SBUF partition, fp32 backward)
- ``grouped_swiglu``: hidden_size a multiple of P; moe_intermediate_size a multiple of
                      P x LNC (the hidden dimension is split over the cores); one expert's
                      share of the weights resident in SBUF (``kernel_limits``, checked for
                      fp32, the largest dtype); the expert count divisible by the
                      expert-parallel degree

The SBUF arithmetic behind the size limits is in ``kernel_limits``.
"""

from __future__ import annotations

from dataclasses import dataclass

from qwen3_titan_common.errors import UserInputError

from qwen3_titan_nki_moe import kernel_limits
from qwen3_titan_nki_moe.kernel_limits import MAX_NORM_DIM, MAX_ROPE_HEAD_DIM, PARTITIONS

# The shape rules are checked before the run's dtype is known: assume the widest.
RULE_ITEMSIZE = kernel_limits.FP32


class KernelConstraintError(UserInputError):
    """A shape an NKI kernel cannot run; the message is one line naming the flag."""


@dataclass(frozen=True)
class KernelShape:
    """What the NKI kernels see of a run."""

    seq_len: int
    head_dim: int
    hidden_size: int
    rope_cache_len: int
    lnc: int
    num_experts: int | None = None
    moe_intermediate_size: int | None = None
    ep_degree: int = 1


@dataclass(frozen=True)
class Violation:
    op: str
    flag: str  # e.g. "--training.seq_len" or "config.json head_dim"
    value: int
    rule: str  # e.g. "a multiple of 256 (128 x LNC=2)"
    nearest: int

    def message(self) -> str:
        return f"{self.flag} {self.value}: the NKI {self.op} kernel needs {self.rule}; nearest valid: {self.nearest}"


def nearest_multiple(value: int, step: int) -> int:
    """The multiple of ``step`` closest to ``value`` (ties round up), at least ``step``."""
    return step * max(1, (value + step // 2) // step)


def nearest_divisor(value: int, of: int) -> int:
    """The divisor of ``of`` closest to ``value`` (ties pick the smaller)."""
    divisors = [d for d in range(1, of + 1) if of % d == 0]
    return min(divisors, key=lambda d: (abs(d - value), d))


def _nearest_valid_head_dim(head_dim: int) -> int:
    if head_dim > MAX_ROPE_HEAD_DIM:
        return MAX_ROPE_HEAD_DIM
    return head_dim - 1 if head_dim % 2 else head_dim


def violations(shape: KernelShape) -> list[Violation]:
    """Every rule the shape breaks, in the order the module docstring lists them."""
    found: list[Violation] = []
    rows = PARTITIONS * shape.lnc
    lnc_rule = f"a multiple of {rows} ({PARTITIONS} x LNC={shape.lnc})"

    for op in ("rope_hf", "rms_norm"):
        if shape.seq_len % rows:
            found.append(
                Violation(
                    op, "--training.seq_len", shape.seq_len, lnc_rule, nearest_multiple(shape.seq_len, rows)
                )
            )
    if shape.seq_len > shape.rope_cache_len:
        cap = max(rows, shape.rope_cache_len // rows * rows)
        found.append(
            Violation(
                "rope_hf",
                "--training.seq_len",
                shape.seq_len,
                f"at most the RoPE cache length {shape.rope_cache_len} (max_position_embeddings)",
                cap,
            )
        )
    if shape.head_dim % 2 or shape.head_dim > MAX_ROPE_HEAD_DIM:
        found.append(
            Violation(
                "rope_hf",
                "config.json head_dim",
                shape.head_dim,
                f"an even head_dim <= {MAX_ROPE_HEAD_DIM}",
                _nearest_valid_head_dim(shape.head_dim),
            )
        )
    if shape.hidden_size > MAX_NORM_DIM:
        found.append(
            Violation(
                "rms_norm", "config.json hidden_size", shape.hidden_size, f"<= {MAX_NORM_DIM}", MAX_NORM_DIM
            )
        )

    if shape.num_experts is not None:
        if shape.hidden_size % PARTITIONS:
            found.append(
                Violation(
                    "grouped_swiglu",
                    "config.json hidden_size",
                    shape.hidden_size,
                    f"a multiple of {PARTITIONS}",
                    nearest_multiple(shape.hidden_size, PARTITIONS),
                )
            )
        assert shape.moe_intermediate_size is not None
        if shape.moe_intermediate_size % rows:
            found.append(
                Violation(
                    "grouped_swiglu",
                    "config.json moe_intermediate_size",
                    shape.moe_intermediate_size,
                    lnc_rule,
                    nearest_multiple(shape.moe_intermediate_size, rows),
                )
            )
        elif not shape.hidden_size % PARTITIONS:
            found.extend(_resident_weights(shape))
        if shape.num_experts % shape.ep_degree:
            found.append(
                Violation(
                    "grouped_swiglu",
                    "--parallelism.expert_parallel_degree",
                    shape.ep_degree,
                    f"a divisor of the expert count {shape.num_experts}",
                    nearest_divisor(shape.ep_degree, shape.num_experts),
                )
            )
    return found


def _resident_weights(shape: KernelShape) -> list[Violation]:
    """One expert's share of the weights (``moe_intermediate_size / LNC`` rows) must fit SBUF."""
    assert shape.moe_intermediate_size is not None
    hidden = shape.moe_intermediate_size // shape.lnc
    if kernel_limits.grouped_swiglu_fits(shape.hidden_size, hidden, RULE_ITEMSIZE):
        return []
    largest = kernel_limits.max_grouped_swiglu_hidden(shape.hidden_size, RULE_ITEMSIZE) * shape.lnc
    if largest == 0:
        return [
            Violation(
                "grouped_swiglu",
                "config.json hidden_size",
                shape.hidden_size,
                "one expert's weights in SBUF (kernel_limits.grouped_swiglu_bytes, fp32)",
                _largest_hidden_size(shape.lnc),
            )
        ]
    return [
        Violation(
            "grouped_swiglu",
            "config.json moe_intermediate_size",
            shape.moe_intermediate_size,
            f"one expert's weights in SBUF at hidden_size {shape.hidden_size} "
            "(kernel_limits.grouped_swiglu_bytes, fp32)",
            largest,
        )
    ]


def _largest_hidden_size(lnc: int) -> int:
    """The largest hidden_size (a multiple of 128) with room for one 128-row share per core."""
    dim = PARTITIONS
    while kernel_limits.grouped_swiglu_fits(dim + PARTITIONS, PARTITIONS, RULE_ITEMSIZE):
        dim += PARTITIONS
    return dim


def violations_by_op(shape: KernelShape) -> dict[str, list[Violation]]:
    by_op: dict[str, list[Violation]] = {}
    for violation in violations(shape):
        by_op.setdefault(violation.op, []).append(violation)
    return by_op


def check(shape: KernelShape) -> None:
    """Raise :class:`KernelConstraintError` with the first broken rule's one-line message."""
    found = violations(shape)
    if found:
        raise KernelConstraintError(found[0].message())


def kernel_shape(config) -> KernelShape:
    """The :class:`KernelShape` of a torchtitan ``Trainer.Config`` built from a Qwen3 model spec."""
    from qwen3_titan_common.runtime.neuron_env import logical_core_size

    model = config.model_spec.model
    layer = model.layers[0]
    attention = layer.attention
    head_dim = attention.head_dim or model.dim // attention.n_heads
    moe = getattr(layer, "moe", None)
    experts = moe.routed_experts.inner_experts if moe is not None else None
    return KernelShape(
        seq_len=config.training.seq_len,
        head_dim=head_dim,
        hidden_size=model.dim,
        rope_cache_len=attention.rope.max_seq_len,
        lnc=logical_core_size(),
        num_experts=experts.num_experts if experts is not None else None,
        moe_intermediate_size=experts.hidden_dim if experts is not None else None,
        ep_degree=config.parallelism.expert_parallel_degree,
    )
