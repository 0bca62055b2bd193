"""Kernel launches with less host work per call than `kernel[grid](...)`.

Prefill runs eagerly, and at gemma3-1b's sizes it is host-bound: Triton's JIT entry point binds
and specializes every argument, hashes the result and looks the compiled kernel up on each call
(~20 us on the benchmark host). `launch` keys a small cache on exactly what the JIT specializes
on, computed in a few Python operations:

    tensor ..... dtype, data pointer divisible by 16
    int ........ equal to 1, divisible by 16, fits in int32
    other ...... the value itself (constexprs, flags, None); floats: their type

The first call of a key goes through the JIT (compiling if needed) and remembers the compiled
kernel; later calls launch it directly on the current stream. A key is never coarser than the
JIT's specialization, so a cached kernel only ever runs arguments it was compiled for. Launch
hooks (`triton.knobs.runtime.launch_enter_hook`) are not called on the direct path.
Under TRITON_INTERPRET=1 every call goes through the interpreter. Launch arithmetic uses
`cdiv` and `next_power_of_2` from here: Triton's are constexpr functions, slow to call from the
host.
"""

from __future__ import annotations

import os

import torch
from triton.runtime.jit import JITFunction

_DIRECT = os.environ.get("TRITON_INTERPRET") != "1"
_KERNELS: dict[tuple, object] = {}
_TENSOR = torch.Tensor


def set_direct(direct: bool) -> None:
    """Launch through the cache (default) or through Triton's JIT on every call."""
    global _DIRECT
    _DIRECT = direct and os.environ.get("TRITON_INTERPRET") != "1"


def cdiv(a: int, b: int) -> int:
    """triton.cdiv for host code (Triton's is a constexpr function: ~4 us per call there)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _spec(value) -> object:
    kind = type(value)
    if kind is torch.Tensor:
        return value.dtype, not value.data_ptr() & 15
    if kind is int:
        return value == 1, not value & 15, -0x80000000 <= value < 0x80000000
    if kind is float:
        return float
    return value


def launch(kernel: JITFunction, grid: tuple[int, ...], *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs), where `args` are the kernel's runtime arguments in order
    and `kwargs` its constexprs (every remaining parameter) and launch options (num_warps...)."""
    if not _DIRECT or not isinstance(kernel, JITFunction):
        kernel[grid](*args, **kwargs)
        return
    device = torch._C._cuda_getDevice()
    # NOTE: a JIT's hash is slow; _spec inlined for tensors, the most common argument
    key = (id(kernel), device, *[(a.dtype, not a.data_ptr() & 15) if type(a) is _TENSOR
                                 else _spec(a) for a in args], *kwargs.items())
    compiled = _KERNELS.get(key)
    if compiled is None:
        params = kernel.params[:len(args)]
        assert not any(p.is_constexpr for p in params), f"{kernel}: pass constexprs by name"
        assert all(p.name in kwargs for p in kernel.params[len(args):]), kernel
        compiled = kernel[grid](*args, **kwargs)
        _KERNELS[key] = compiled.result() if hasattr(compiled, "result") else compiled
        return
    values = args + tuple(kwargs[name] for name in kernel.arg_names[len(args):])
    grid = (*grid, 1, 1)
    compiled.run(grid[0], grid[1], grid[2], torch._C._cuda_getCurrentRawStream(device),
                 compiled.function, compiled.packed_metadata, None, None, None, *values)
