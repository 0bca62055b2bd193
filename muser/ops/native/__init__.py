"""Compiled CPU kernels for the decode width: C sources beside this file (qgemv.c: projections
over packed int8 codes; norms.c: RMSNorm and QK-norm + RoPE of a few rows; attention.c: one
query row per head over a sequence's keys), built once per
machine with the system C compiler (`$CC`, else `cc`) into muser's cache, called via ctypes.

The build is keyed by the sources, the flags, the compiler's version and the CPU's feature
flags, so a changed machine or source rebuilds. `muser.ops.cpu` calls these for decode rows;
each has its torch reference in `muser.ops.ref`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from muser.errors import MuserError
from muser.ops.packed import PackedMatrix

SOURCES = [Path(__file__).with_name(name) for name in ("qgemv.c", "norms.c", "attention.c")]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
MAX_ROWS = 8  # rows per call the kernel takes (MAX_ROWS in qgemv.c)


class NativeUnavailable(MuserError):
    """The C kernels could not be built or loaded on this machine."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(cc: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run([cc, *FLAGS, "-o", str(out), *map(str, SOURCES), "-lm"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise NativeUnavailable(f"building the CPU kernels with {cc} failed:\n"
                                    f"{proc.stderr.strip()}")
        os.replace(out, target)  # atomic: concurrent builders agree on the result


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded kernel library, built on first use."""
    from muser.loading.default_model import cache_dir

    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise NativeUnavailable(f"no C compiler '{cc}' on PATH (set CC, or install gcc)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join(
        [*(src.read_text() for src in SOURCES), " ".join(FLAGS), version, _cpu_flags(),
         platform.machine()]
    ).encode()).hexdigest()[:16]
    target = cache_dir() / "native" / f"muser-cpu-{key}.so"
    if not target.exists():
        _build(cc, target)
    lib = ctypes.CDLL(str(target))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.muser_qgemv.argtypes = [p, i64, i64, p, p, p, p, i64, i64, p, ctypes.c_int]
    lib.muser_qgemv.restype = ctypes.c_int
    f32 = ctypes.c_float
    lib.muser_rms_norm.argtypes = [p, i64, i64, i64, p, f32, p]
    lib.muser_add_rms_norm.argtypes = [p, p, i64, i64, p, p, f32, p, p]
    lib.muser_qk_norm_rope.argtypes = [p, i64, i64, i64, i64, i64, p, p, p, f32, p]
    lib.muser_decode_attention.argtypes = [p, i64, i64, i64, p, p, i64, i64, i64, f32, p, p]
    for fn in (lib.muser_rms_norm, lib.muser_add_rms_norm, lib.muser_qk_norm_rope,
               lib.muser_decode_attention):
        fn.restype = None
    return lib


@functools.cache
def available() -> bool:
    """Whether the kernels build and load here (callers that must have them use library())."""
    try:
        library()
    except NativeUnavailable:
        return False
    return True


def qgemv(x: torch.Tensor, w: PackedMatrix) -> torch.Tensor:
    """x: [N, K] (N <= MAX_ROWS) -> x @ w.T: [N, M] float32, reading w's int8 codes."""
    x = x.float().contiguous()
    n, k = x.shape
    m = w.codes.shape[0]
    y = torch.empty(n, m, dtype=torch.float32)
    xsum = None
    if w.mins is not None:
        xsum = x.view(n, -1, w.group).sum(-1).contiguous()
    rc = library().muser_qgemv(
        x.data_ptr(), n, k, w.codes.data_ptr(), w.scales.data_ptr(),
        None if w.mins is None else w.mins.data_ptr(), None if xsum is None else xsum.data_ptr(),
        m, w.group, y.data_ptr(), torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"qgemv rejected x {tuple(x.shape)} against codes "
                         f"{tuple(w.codes.shape)} in groups of {w.group}")
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [N, D] float32 (unit inner stride) -> rms_norm(x) * weight, [N, D] float32."""
    n, d = x.shape
    assert x.dtype == weight.dtype == torch.float32 and x.stride(1) == 1
    y = torch.empty(n, d)
    library().muser_rms_norm(x.data_ptr(), n, d, x.stride(0), weight.contiguous().data_ptr(),
                             eps, y.data_ptr())
    return y


def add_rms_norm(
    residual: torch.Tensor, x: torch.Tensor, post: torch.Tensor, nxt: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """ref.add_rms_norm for [N, D] float32 rows -> (new residual, its norm by `nxt`)."""
    n, d = x.shape
    residual, x = residual.contiguous(), x.contiguous()
    assert residual.dtype == x.dtype == post.dtype == nxt.dtype == torch.float32
    h, y = torch.empty(n, d), torch.empty(n, d)
    library().muser_add_rms_norm(residual.data_ptr(), x.data_ptr(), n, d, post.data_ptr(),
                                 nxt.data_ptr(), eps, h.data_ptr(), y.data_ptr())
    return h, y


def qk_norm_rope(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> torch.Tensor:
    """ref.qk_norm_rope for x: [N, heads, head_dim] float32 (unit inner stride) -> contiguous
    [N, heads, head_dim] float32."""
    n, heads, hd = x.shape
    assert x.dtype == torch.float32 and x.stride(2) == 1 and cos.shape == (n, hd // 2)
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(n, heads, hd)
    library().muser_qk_norm_rope(x.data_ptr(), n, heads, hd, x.stride(0), x.stride(1),
                                 weight.data_ptr(), cos.data_ptr(), sin.data_ptr(), eps,
                                 out.data_ptr())
    return out


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                     ) -> torch.Tensor:
    """dense_ref.attention_decode for float32: q [H, D] over keys/values [S, KVH, D] (any row
    stride, unit inner stride, k and v alike) -> [H, D] float32."""
    heads, d = q.shape
    s, kv_heads = k.shape[0], k.shape[1]
    assert q.dtype == k.dtype == v.dtype == torch.float32 and k.stride() == v.stride()
    assert k.stride(2) == 1 and heads % kv_heads == 0
    q = q.contiguous()
    scores, out = torch.empty(heads, s), torch.empty(heads, d)
    library().muser_decode_attention(q.data_ptr(), heads, kv_heads, d, k.data_ptr(),
                                     v.data_ptr(), s, k.stride(0), k.stride(1), scale,
                                     scores.data_ptr(), out.data_ptr())
    return out
