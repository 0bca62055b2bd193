"""Kernel launches with less host work per call than `kernel[grid](...)`.

Prefill runs eagerly, and at gemma3-1b's sizes it is host-bound: Triton's JIT entry point binds
and specializes every argument, hashes the result and looks the compiled kernel up on each call
(~20 us on the benchmark host). `launch` keys a small cache on exactly what the JIT specializes
on, computed in a few Python operations:

    tensor ..... dtype, data pointer divisible by 16
    int ........ equal to 1, divisible by 16, fits in int32
    float ...... its type
    other ...... the value itself (None, flags); constexprs and options: name and value

The first call of a key goes through the JIT (compiling if needed) and remembers the compiled
kernel; later calls hand it to the kernel's C launcher directly, on the current stream, with
tensors passed as their data pointers (given a tensor, the launcher calls its data_ptr() and
asks the driver about the pointer on every call). A key is never coarser than the JIT's
specialization, so a cached kernel only ever runs arguments it was compiled for. Launch hooks
(`triton.knobs.runtime.launch_enter_hook`) are not called on the direct path, and neither is
the launcher's check that a pointer is a device pointer: the first call of each key made it.
Inside `compile_only` (muser/ops/triton/tuning.py) a launch compiles its kernel and runs
nothing, once per key: until the compile pass ends, the JIT has no kernel cached for it and would
redo its whole cache-key work (signature, source hash) on every launch of every layer. Under
TRITON_INTERPRET=1 every call goes through the interpreter. Launch arithmetic uses `cdiv` and
`next_power_of_2` from here: Triton's are constexpr functions, slow to call from the host.
"""

from __future__ import annotations

from contextvars import ContextVar

import torch
from triton.runtime.jit import JITFunction

from muser.env import triton_interpret
from muser.ops.triton.switches import current as switches_in_force

_INTERPRET = triton_interpret()
_KERNELS: dict[tuple, object] = {}
_COMPILED: set[tuple] = set()  # keys already handed to the JIT inside compile_only
_TENSOR = torch.Tensor
compile_only: ContextVar[bool] = ContextVar("muser_compile_only", default=False)


def cdiv(a: int, b: int) -> int:
    """triton.cdiv for host code (Triton's is a constexpr function: ~4 us per call there)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _bind(args: tuple, key: list) -> tuple[list, list]:
    """-> (the launcher's values of `args`, `key` extended by what the JIT specializes each
    on). One loop, no calls: this runs ~130 times per prefill forward."""
    # NOTE: tensors travel as their data pointers (read once, for the key too): the launcher
    # would otherwise call data_ptr() and query the driver about each pointer on every call.
    values = []
    for a in args:
        kind = type(a)
        if kind is _TENSOR:
            ptr = a.data_ptr()
            values.append(ptr)
            key.append((a.dtype, not ptr & 15))
            continue
        values.append(a)
        if kind is int:
            key.append((a == 1, not a & 15, -0x80000000 <= a < 0x80000000))
        else:
            key.append(float if kind is float else a)
    return values, key


def launch(kernel: JITFunction, grid: tuple[int, ...], *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs), where `args` are the kernel's runtime arguments in order
    and `kwargs` its constexprs (every remaining parameter) and launch options (num_warps...)."""
    if _INTERPRET or not isinstance(kernel, JITFunction) or not switches_in_force().direct:
        kernel[grid](*args, **kwargs)
        return
    device = torch._C._cuda_getDevice()
    values, key = _bind(args, [id(kernel), device])
    key.extend(kwargs.items())
    key = tuple(key)
    if compile_only.get():
        if key not in _COMPILED:
            _COMPILED.add(key)
            kernel.warmup(*args, grid=grid, **kwargs)
        return
    entry = _KERNELS.get(key)
    if entry is None:
        _KERNELS[key] = _first_launch(kernel, grid, args, kwargs)
        return
    run, head, tail = entry
    grid = (*grid, 1, 1)
    run(grid[0], grid[1], grid[2], torch._C._cuda_getCurrentRawStream(device), *head, *values,
        *tail)


def _first_launch(kernel: JITFunction, grid: tuple[int, ...], args: tuple, kwargs: dict):
    """Launch through the JIT (compiling if needed) -> what later launches of the same key
    call: the compiled kernel's launcher, its arguments before the kernel's, and the values of
    the constexprs after them."""
    params = kernel.params[:len(args)]
    assert not any(p.is_constexpr for p in params), f"{kernel}: pass constexprs by name"
    assert all(p.name in kwargs for p in kernel.params[len(args):]), kernel
    compiled = kernel[grid](*args, **kwargs)
    compiled = compiled.result() if hasattr(compiled, "result") else compiled
    launcher = compiled.run
    tail = tuple(kwargs[name] for name in kernel.arg_names[len(args):])
    if launcher.global_scratch_size or launcher.profile_scratch_size:
        # the Python launcher allocates the kernel's scratch on each call
        return launcher, (compiled.function, compiled.packed_metadata, None, None, None), tail
    return launcher.launch, (
        compiled.function, launcher.launch_cooperative_grid, launcher.launch_pdl, None, None,
        compiled.packed_metadata, None, None, None), tail
