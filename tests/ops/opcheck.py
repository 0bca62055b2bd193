"""Helpers of the kernel tests: device, dtypes, tolerances, seeded inputs.

Without CUDA the kernels run in the interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets
before anything imports Triton; fp32/fp16 only, since the interpreter computes bf16 wrongly).
Every kernel output is poisoned (conftest.py's `poisoned` fixture).
"""

from __future__ import annotations

import torch

HAS_CUDA = torch.cuda.is_available()


def _patch_interpreter_index() -> None:
    """Triton 3.6's interpreter turns a loop bound loaded from memory into int() of a 1-element
    numpy array, which numpy 2 refuses; take the element instead (interpreter only)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


if not HAS_CUDA:
    try:
        _patch_interpreter_index()
    except ImportError:
        pass

DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
ATTN_DTYPES = [torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
MAX_SUM = 4096  # the longest float32 accumulation in these tests (terms of magnitude <= scale)
ROUNDINGS = 8  # roundings in the kernel's dtype on one path: the output store, and up to three
# intermediates stored in it (normed activations, attention weights, GeGLU products), each at
# most doubled by the product that follows


def _tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) of |out - ref| <= atol * scale + rtol * |ref|, ref in float64 on the same
    dtype-rounded inputs. Each rounding in dtype is within u of the value rounded: the output
    (rtol), or an intermediate whose magnitude the caller bounds by `scale` (atol); a float32
    sum of up to MAX_SUM terms is within gamma_MAX_SUM(u32) of the sum of their magnitudes,
    which the caller also bounds by `scale`."""
    u, u32 = UNIT_ROUNDOFF[dtype], UNIT_ROUNDOFF[torch.float32]
    gamma = MAX_SUM * u32 / (1 - MAX_SUM * u32)
    return ROUNDINGS * u + gamma, ROUNDINGS * u


TOL = {dtype: _tolerance(dtype) for dtype in UNIT_ROUNDOFF}


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    atol, rtol = TOL[dtype]
    out, ref = out.double().cpu(), ref.double().cpu()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert not out.isnan().any(), "NaN in the output: an element was never written"
    err = (out - ref).abs()
    worst = (err - (atol * scale + rtol * ref.abs())).max().item()
    assert worst <= 0, f"max excess {worst:.3g}, max abs err {err.max().item():.3g}"


def rand(gen: torch.Generator, *shape: int, dtype=torch.float32, scale: float = 1.0):
    """Seeded normal values (never zeros) on the test device."""
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(DEVICE)
