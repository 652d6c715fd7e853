"""A CPU twin of the NKI API our kernels use, standing in for hardware and a toolchain we do not have.

Trainium is not here, and neither is the Neuron repository's ``nki`` package (a proprietary
wheel; PyPI's ``nki`` is a placeholder), whose ``nki.simulate`` would be the real CPU check
(``tools/run_neuron_tests.py --simulate`` runs it where it is installed). So the tests run the
kernels' own source against this twin: every ``nki.isa`` / ``nki.language`` call they make is
executed with torch on CPU tensors, with the semantics the NKI 0.7 documentation gives:

- tensors are views over flat storage; ``.ap(pattern, offset, scalar_offset, indirect_dim)``
  addresses ``offset + scalar * prod(shape[indirect_dim + 1:])`` with ``[[step, num], ...]``;
  an access outside the tensor raises (the hardware's ``oob_mode.error``);
- ``nc_matmul`` is ``stationary.T @ moving`` in fp32, stationary at most 128 x 128, moving at
  most 128 x 512, the output in one PSUM bank, ``accumulate`` explicit; ``nc_transpose`` reads
  SBUF, writes PSUM in the same dtype; GpSimd never touches PSUM;
- the engines compute in fp32 and round once, to the destination's dtype;
- new tiles are filled with NaN (ints with 4), as ``nki.simulate`` does, so a read of memory
  no instruction wrote shows up in the result;
- ``kernel[(lnc,)]`` runs the kernel once per program id; ``shared_hbm`` outputs are shared by
  the programs (the k-th allocation of every program is the same tensor);
- ``nl.fori_loop`` runs its body for every index; the body receives a plain int (the twin of an
  ``NkiScalar``).

It also measures what the compiler would see: the SBUF/PSUM bytes per partition of every
allocation site (keyed by the call stack inside the kernel package, largest tile per site),
and the instructions of the traced program (a ``fori_loop`` body counted once, as it is
emitted once). What it cannot tell: whether the real compiler accepts the code, instruction
timing, and anything the documentation does not say.

The torch-neuronx side has a twin too (``FakeTorchNeuronx``): ``wrap_nki`` whose
``__getitem__`` runs ``tuple(map(int, grid))`` as one torch-neuronx version does (a bare int
grid fails there), and ``nki_op`` as a callable whose ``register_autograd`` is wired through a
``torch.autograd.Function``.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import sys
import types
from dataclasses import dataclass, field

import torch

KERNEL_PATH_PART = "qwen3_titan_nki_moe/nki/"
PARTITIONS = 128
MOVING_MAX = 512
PSUM_BANK_BYTES = 2048


# ---- buffers, tensors, scalars ---------------------------------------------------------------


@dataclass(frozen=True)
class Buffer:
    name: str

    def __repr__(self) -> str:
        return self.name


SBUF, PSUM, HBM, SHARED_HBM = Buffer("sbuf"), Buffer("psum"), Buffer("hbm"), Buffer("shared_hbm")
ON_CHIP = (SBUF, PSUM)


class FakeNkiError(AssertionError):
    """An NKI rule the kernel broke (the real compiler or simulator would refuse it too)."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise FakeNkiError(message)


@dataclass(frozen=True)
class DynamicSlice:
    start: int
    size: int


class FakeTensor:
    """An NKI tensor view: flat storage, shape, strides, element offset, buffer."""

    def __init__(self, storage: torch.Tensor, shape, strides, offset: int, buffer: Buffer):
        self.storage = storage
        self.shape = tuple(int(s) for s in shape)
        self.strides = tuple(int(s) for s in strides)
        self.offset = int(offset)
        self.buffer = buffer
        if buffer in ON_CHIP:
            _check(
                len(self.shape) >= 2 or self.shape == (1,), f"on-chip tensor {self.shape}: at least 2 dims"
            )
            _check(self.shape[0] <= PARTITIONS, f"{buffer} tile with {self.shape[0]} partitions (max 128)")
        lo, hi = self._extent()
        _check(
            lo >= 0 and hi < storage.numel(),
            f"access out of bounds: elements {lo}..{hi} of {storage.numel()}",
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    def _extent(self) -> tuple[int, int]:
        if any(s == 0 for s in self.shape):
            return self.offset, self.offset
        lo = self.offset + sum((n - 1) * st for n, st in zip(self.shape, self.strides, strict=True) if st < 0)
        hi = self.offset + sum((n - 1) * st for n, st in zip(self.shape, self.strides, strict=True) if st > 0)
        return lo, hi

    @classmethod
    def allocate(cls, shape, dtype: torch.dtype, buffer: Buffer) -> FakeTensor:
        shape = tuple(int(s) for s in shape)
        fill = float("nan") if dtype.is_floating_point else 4
        storage = torch.full((math.prod(shape),), fill, dtype=dtype)
        return cls(storage, shape, _contiguous_strides(shape), 0, buffer)

    @classmethod
    def from_torch(cls, tensor: torch.Tensor) -> FakeTensor:
        data = tensor.detach().contiguous().clone().reshape(-1)
        return cls(data, tensor.shape, _contiguous_strides(tensor.shape), 0, HBM)

    def torch(self) -> torch.Tensor:
        return torch.as_strided(self.storage, self.shape, self.strides, self.offset)

    def per_partition(self) -> torch.Tensor:
        """``[partitions, elements]`` (a copy when the free axes are strided)."""
        return self.torch().reshape(self.shape[0], -1)

    def __getitem__(self, key) -> FakeTensor:
        key = key if isinstance(key, tuple) else (key,)
        if Ellipsis in key:
            at = key.index(Ellipsis)
            key = key[:at] + (slice(None),) * (len(self.shape) - len(key) + 1) + key[at + 1 :]
        key = key + (slice(None),) * (len(self.shape) - len(key))
        shape, strides, offset = [], [], self.offset
        for dim, (k, size, stride) in enumerate(zip(key, self.shape, self.strides, strict=True)):
            if isinstance(k, slice):
                start, stop, step = k.indices(size)
                shape.append(len(range(start, stop, step)))
                strides.append(stride * step)
                offset += start * stride
            elif isinstance(k, DynamicSlice):
                _check(0 <= k.start and k.start + k.size <= size, f"ds({k.start}, {k.size}) outside {size}")
                shape.append(k.size)
                strides.append(stride)
                offset += k.start * stride
            else:
                index = int(k)
                _check(0 <= index < size, f"index {index} outside {size}")
                offset += index * stride
                if dim == 0 and self.buffer in ON_CHIP:  # the partition dim stays, size 1
                    shape.append(1)
                    strides.append(stride)
        return FakeTensor(self.storage, shape, strides, offset, self.buffer)

    def ap(self, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim=0, dtype=None):
        _check(vector_offset is None and dtype is None, "the twin implements scalar_offset only")
        base = self.offset if offset is None else self.offset + int(offset)
        if scalar_offset is not None:
            base += scalar_value(scalar_offset) * math.prod(self.shape[indirect_dim + 1 :])
        return FakeTensor(
            self.storage, [num for _, num in pattern], [step for step, _ in pattern], base, self.buffer
        )

    def broadcast(self, dim: int, size: int) -> FakeTensor:
        _check(self.shape[dim] == 1, f"broadcast of dim {dim} of size {self.shape[dim]} (must be 1)")
        _check(
            not (dim == 0 and self.buffer in ON_CHIP), "on-chip tensors cannot broadcast the partition dim"
        )
        shape, strides = list(self.shape), list(self.strides)
        shape[dim], strides[dim] = size, 0
        return FakeTensor(self.storage, shape, strides, self.offset, self.buffer)


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= int(size)
    return tuple(reversed(strides))


def scalar_value(value) -> int:
    """A run-time scalar: an int (the twin of an NkiScalar) or a ``(1, 1)`` int32 SBUF tile."""
    if isinstance(value, FakeTensor):
        _check(
            value.shape == (1, 1) and value.buffer is SBUF,
            f"scalar_offset tile {value.shape} in {value.buffer}",
        )
        _check(value.dtype == torch.int32, f"scalar_offset tile of {value.dtype} (int32 expected)")
        return int(value.torch().item())
    _check(isinstance(value, int), f"scalar {value!r}: an int (NkiScalar) or a (1, 1) SBUF tile expected")
    return value


# ---- the launch state: programs, shared outputs, measurements ---------------------------------


@dataclass
class Measure:
    """What one launch allocated and emitted (program 0's trace)."""

    sites: dict[str, dict[tuple, int]] = field(default_factory=lambda: {"sbuf": {}, "psum": {}})
    instructions: int = 0

    def footprint(self, buffer: str) -> int:
        return sum(self.sites[buffer].values())


class _State:
    def __init__(self):
        self.grid: tuple[int, ...] = ()
        self.program = 0
        self.shared: list[FakeTensor] = []
        self.shared_index = 0
        self.counting = False
        self.measure = Measure()
        self.launches: list[Measure] = []


STATE = _State()


def _site() -> tuple:
    frames, frame = [], sys._getframe(2)
    while frame is not None:
        if KERNEL_PATH_PART in frame.f_code.co_filename.replace("\\", "/"):
            frames.append((frame.f_code.co_filename, frame.f_lineno))
        frame = frame.f_back
    return tuple(frames)


def _instruction() -> None:
    if STATE.counting:
        STATE.measure.instructions += 1


# ---- nki.language ------------------------------------------------------------------------------


def ndarray(shape, dtype, buffer=SBUF, name="", address=None):
    if buffer is SHARED_HBM and STATE.program > 0:
        tensor = STATE.shared[STATE.shared_index]
        STATE.shared_index += 1
        _check(tensor.shape == tuple(shape) and tensor.dtype == dtype, "programs allocate different outputs")
        return tensor
    tensor = FakeTensor.allocate(shape, dtype, buffer)
    if buffer is SHARED_HBM:
        STATE.shared.append(tensor)
    if buffer in ON_CHIP:
        nbytes = math.prod(tensor.shape[1:]) * dtype.itemsize
        if buffer is PSUM:
            _check(nbytes <= PSUM_BANK_BYTES, f"PSUM tile of {nbytes} bytes per partition (one bank: 2 KiB)")
        sites = STATE.measure.sites[buffer.name]
        site = _site()
        sites[site] = max(sites.get(site, 0), nbytes)
    return tensor


def ds(start, size) -> DynamicSlice:
    return DynamicSlice(int(start), int(size))


def program_id(axis=0) -> int:
    _check(axis == 0, "one-dimensional grids only")
    return STATE.program


def num_programs(axes=0) -> int:
    _check(axes == 0, "one-dimensional grids only")
    return STATE.grid[0]


def fori_loop(lower, upper, body_fun, step=1) -> None:
    """Every iteration runs; only the first is counted (the body is emitted once)."""
    counting = STATE.counting
    for index, i in enumerate(range(scalar_value(lower), scalar_value(upper), step)):
        STATE.counting = counting and index == 0
        body_fun(i)
    STATE.counting = counting


def _silu_dx(x):
    sig = torch.sigmoid(x)
    return sig * (1 + x * (1 - sig))


language = types.ModuleType("nki.language")
language.__dict__.update(
    ndarray=ndarray,
    ds=ds,
    program_id=program_id,
    num_programs=num_programs,
    fori_loop=fori_loop,
    sbuf=SBUF,
    psum=PSUM,
    hbm=HBM,
    shared_hbm=SHARED_HBM,
    float32=torch.float32,
    bfloat16=torch.bfloat16,
    float16=torch.float16,
    int32=torch.int32,
    add=torch.add,
    subtract=torch.subtract,
    multiply=torch.multiply,
    silu=torch.nn.functional.silu,
    silu_dx=_silu_dx,
    sigmoid=torch.sigmoid,
    square=torch.square,
    rsqrt=torch.rsqrt,
    copy=lambda x: x,
)
language.tile_size = types.SimpleNamespace(
    pmax=PARTITIONS, gemm_stationary_fmax=128, gemm_moving_fmax=MOVING_MAX
)
UNARY = {torch.rsqrt, torch.square}


# ---- nki.isa -----------------------------------------------------------------------------------

engine = types.SimpleNamespace(
    unknown="unknown", vector="vector", scalar="scalar", gpsimd="gpsimd", tensor="tensor"
)
reduce_cmd = types.SimpleNamespace(idle="idle", reset="reset", reduce="reduce", reset_reduce="reset_reduce")


def _write(dst: FakeTensor, value: torch.Tensor) -> None:
    """Round once to the destination's dtype (the engines compute in fp32)."""
    target = dst.torch()
    _check(value.numel() == target.numel(), f"writing {tuple(value.shape)} into {dst.shape}")
    target.copy_(value.reshape(target.shape).to(dst.dtype))


def _same_layout(*tiles: FakeTensor) -> None:
    first = tiles[0]
    for tile in tiles[1:]:
        _check(
            tile.shape[0] == first.shape[0] and math.prod(tile.shape[1:]) == math.prod(first.shape[1:]),
            f"tiles {first.shape} and {tile.shape}: same partitions and elements per partition expected",
        )


def _operand(value, like: torch.Tensor) -> torch.Tensor | float:
    """A scalar, or a ``[P, 1]`` tile broadcast along the free axis."""
    if isinstance(value, FakeTensor):
        _check(math.prod(value.shape[1:]) == 1, f"vector operand {value.shape}: [P, 1] expected")
        return value.per_partition().float()
    return float(value)


def _apply(op, data, operand, reverse: bool):
    if op in UNARY:
        _check(operand in (None, 0, 0.0), "a unary op takes operand 0")
        return op(data)
    return op(operand, data) if reverse else op(data, operand)


def dma_copy(dst: FakeTensor, src: FakeTensor, **kwargs) -> None:
    _instruction()
    _check(math.prod(dst.shape) == math.prod(src.shape), f"dma_copy {src.shape} -> {dst.shape}: sizes differ")
    # Different dtypes convert through fp32 (documented for the DMA engines).
    _write(dst, src.torch().float() if src.dtype != dst.dtype else src.torch())


def nc_matmul(dst: FakeTensor, stationary: FakeTensor, moving: FakeTensor, accumulate=None, **kwargs) -> None:
    _instruction()
    _check(stationary.buffer is SBUF and moving.buffer is SBUF, "matmul operands must be in SBUF")
    _check(dst.buffer is PSUM and dst.dtype == torch.float32, "matmul writes fp32 PSUM")
    _check(stationary.dtype == moving.dtype, f"matmul of {stationary.dtype} with {moving.dtype}")
    _check(accumulate in (True, False), "pass accumulate explicitly")
    st, mv = stationary.per_partition(), moving.per_partition()
    _check(st.shape[0] == mv.shape[0] <= PARTITIONS, f"contraction {st.shape[0]} vs {mv.shape[0]} (max 128)")
    _check(st.shape[1] <= 128, f"stationary free size {st.shape[1]} (max 128)")
    _check(mv.shape[1] <= MOVING_MAX, f"moving free size {mv.shape[1]} (max 512)")
    _check(dst.shape[0] == st.shape[1] and math.prod(dst.shape[1:]) == mv.shape[1], "matmul output shape")
    result = st.float().T @ mv.float()
    if accumulate:
        current = dst.per_partition()
        _check(not torch.isnan(current).any(), "accumulating onto PSUM no matmul started")
        result = current + result
    _write(dst, result)


def nc_transpose(dst: FakeTensor, data: FakeTensor, **kwargs) -> None:
    _instruction()
    _check(data.buffer is SBUF and dst.buffer is PSUM, "TensorE transpose reads SBUF, writes PSUM")
    _check(data.dtype == dst.dtype, f"transpose of {data.dtype} into {dst.dtype}: same dtype required")
    tile = data.per_partition()
    _check(tile.shape[0] <= 128 and tile.shape[1] <= 128, f"transpose of {tuple(tile.shape)} (max 128 x 128)")
    _write(dst, tile.T)


def tensor_copy(dst: FakeTensor, src: FakeTensor, **kwargs) -> None:
    _instruction()
    _same_layout(dst, src)
    _write(dst, src.per_partition() if src.dtype == dst.dtype else src.per_partition().float())


def tensor_tensor(dst: FakeTensor, data1: FakeTensor, data2: FakeTensor, op, **kwargs) -> None:
    _instruction()
    _same_layout(dst, data1, data2)
    _check(not (data1.buffer is PSUM and data2.buffer is PSUM), "tensor_tensor: both inputs in PSUM")
    _write(dst, op(data1.per_partition().float(), data2.per_partition().float()))


def tensor_scalar(
    dst,
    data,
    op0,
    operand0,
    reverse0=False,
    op1=None,
    operand1=None,
    reverse1=False,
    engine="unknown",
    **kwargs,
) -> None:
    _instruction()
    _same_layout(dst, data)
    if engine == "gpsimd":
        _check(PSUM not in (dst.buffer, data.buffer), "GpSimd cannot access PSUM")
    values = data.per_partition().float()
    result = _apply(op0, values, _operand(operand0, values), reverse0)
    if op1 is not None:
        result = _apply(op1, result, _operand(operand1, values), reverse1)
    _write(dst, result)


def scalar_tensor_tensor(
    dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, **kwargs
) -> None:
    _instruction()
    _same_layout(dst, data, operand1)
    values = data.per_partition().float()
    result = _apply(op0, values, _operand(operand0, values), reverse0)
    _write(dst, _apply(op1, result, operand1.per_partition().float(), reverse1))


def activation(
    dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd="idle", **kwargs
):
    _instruction()
    _same_layout(dst, data)
    values = data.per_partition().float() * _operand(scale, data.per_partition())
    if bias is not None:
        values = values + _operand(bias, values)
    result = op(values)
    _write(dst, result)
    if reduce_res is not None:
        _check(
            reduce_op is torch.add and reduce_cmd == "reset_reduce", "the twin reduces with add, reset_reduce"
        )
        _write(reduce_res, result.sum(dim=1, keepdim=True))


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, **kwargs) -> None:
    _instruction()
    _check(op is torch.add and not negate, "the twin reduces with add")
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    _check(0 not in axes, "tensor_reduce cannot reduce the partition axis")
    _write(dst, data.torch().float().sum(dim=axes))


def memset(dst: FakeTensor, value, **kwargs) -> None:
    _instruction()
    _write(dst, torch.full(dst.shape, float(value)))


def scalar_load(src: FakeTensor) -> int:
    _instruction()
    return scalar_value(src)


isa = types.ModuleType("nki.isa")
isa.__dict__.update(
    engine=engine,
    reduce_cmd=reduce_cmd,
    dma_copy=dma_copy,
    nc_matmul=nc_matmul,
    nc_transpose=nc_transpose,
    tensor_copy=tensor_copy,
    tensor_tensor=tensor_tensor,
    tensor_scalar=tensor_scalar,
    scalar_tensor_tensor=scalar_tensor_tensor,
    activation=activation,
    tensor_reduce=tensor_reduce,
    memset=memset,
    scalar_load=scalar_load,
)


# ---- nki.jit and the launch --------------------------------------------------------------------


class FakeKernel:
    """``@nki.jit``: launch with a grid, ``kernel[(lnc,)](*tensors)``."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__

    def __getitem__(self, grid):
        grid = grid if isinstance(grid, tuple) else (grid,)
        return lambda *args: launch(self, tuple(int(g) for g in grid), args)

    def __call__(self, *args):
        raise FakeNkiError(f"{self.__name__}: launch with a grid, kernel[(lnc,)](...)")


def launch(kernel: FakeKernel, grid: tuple[int, ...], args):
    """Run every program of ``grid`` (sequentially; outputs shared); torch tensors in and out."""
    _check(len(grid) == 1 and grid[0] >= 1, f"grid {grid}: one dimension, LNC programs")
    fake_args = [FakeTensor.from_torch(a) if isinstance(a, torch.Tensor) else a for a in args]
    STATE.grid, STATE.shared, STATE.measure = grid, [], Measure()
    result = None
    try:
        for program in range(grid[0]):
            STATE.program, STATE.shared_index, STATE.counting = program, 0, program == 0
            out = kernel.fn(*fake_args)
            result = out if result is None else result
    finally:
        STATE.counting = False
        STATE.launches.append(STATE.measure)
    if isinstance(result, tuple):
        return tuple(t.torch().clone() for t in result)
    return result.torch().clone()


nki_module = types.ModuleType("nki")
nki_module.jit = FakeKernel
nki_module.isa = isa
nki_module.language = language


# ---- torch-neuronx -----------------------------------------------------------------------------


class FakeTorchNeuronx:
    """``wrap_nki`` and ``nki_op`` as torch-neuronx exposes them, recording what they were asked."""

    def __init__(self):
        self.wrapped: list = []  # one entry per wrap_nki call
        self.grids: list = []  # every grid a wrapped kernel was indexed with
        module = types.ModuleType("torch_neuronx")
        module.wrap_nki = self.wrap_nki
        module.nki_op = self.nki_op
        self.module = module

    def wrap_nki(self, kernel):
        self.wrapped.append(kernel)
        return _HopCaller(self, kernel, None)

    def nki_op(self, name, fn=None, mutates_args=None):
        def decorate(function):
            return _NkiOp(name, function)

        return decorate if fn is None else decorate(fn)


class _HopCaller:
    def __init__(self, owner: FakeTorchNeuronx, kernel: FakeKernel, grid):
        self.owner, self.kernel, self.grid = owner, kernel, grid

    def __getitem__(self, grid):
        grid = tuple(map(int, grid))  # as one torch-neuronx version does: an int grid raises here
        self.owner.grids.append(grid)
        return _HopCaller(self.owner, self.kernel, grid)

    def __call__(self, *args):
        _check(self.grid is not None, "a wrapped kernel is launched with a grid")
        return self.kernel[self.grid](*args)


class _NkiOp:
    def __init__(self, name: str, fn):
        self.name, self.fn = name, fn
        self.backward = self.setup_context = None

    def register_autograd(self, backward, setup_context=None):
        self.backward, self.setup_context = backward, setup_context

    def __call__(self, *args):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if self.backward is None or not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
            return self.fn(*args)
        return _AutogradBridge.apply(self, *args)


class _AutogradBridge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, *args):
        out = op.fn(*args)
        op.setup_context(ctx, args, out)
        ctx.op = op
        return out

    @staticmethod
    def backward(ctx, *grads):
        return (None, *ctx.op.backward(ctx, *grads))


# ---- installing the twins ------------------------------------------------------------------------


@contextlib.contextmanager
def installed(with_torch_neuronx: bool = True):
    """``nki`` (and ``torch_neuronx``) resolve to the twins inside; our kernel modules are imported
    fresh inside and forgotten after, so nothing leaks into other tests."""
    names = ("nki", "nki.isa", "nki.language", "torch_neuronx")
    saved = {name: sys.modules.get(name) for name in names}
    # Thousands of small matmuls: one thread each is faster than two threads contending.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    neuronx = FakeTorchNeuronx()
    STATE.launches = []
    _forget_kernel_modules()
    sys.modules.update({"nki": nki_module, "nki.isa": isa, "nki.language": language})
    if with_torch_neuronx:
        sys.modules["torch_neuronx"] = neuronx.module
    try:
        yield neuronx
    finally:
        torch.set_num_threads(threads)
        _forget_kernel_modules()
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def import_kernel_module(name: str):
    return importlib.import_module(f"qwen3_titan_nki_moe.nki.{name}")


def _forget_kernel_modules() -> None:
    for name in [m for m in sys.modules if m.startswith("qwen3_titan_nki_moe.nki")]:
        del sys.modules[name]
    package = sys.modules.get("qwen3_titan_nki_moe")
    if package is not None and hasattr(package, "nki"):
        delattr(package, "nki")
