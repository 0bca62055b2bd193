"""Compiled CPU kernels, at every width: C sources beside this file (gemm.c: projections over
packed matrices; norms.c: RMSNorm, QK-norm + RoPE, RoPE angles, GeGLU; attention.c: query rows
over a sequence's keys; noise.c: the sampler's draw; bands.c: top-p's mass per
power-of-two band), built once per machine
with the system C compiler (`$CC`, else `cc`) into muser's cache, a compiler process a source
in parallel (build.py), called via ctypes.

Each output is reduced in one fixed order whatever the number of rows (see each source's
header), which is what makes the CPU backend bitwise the same at every chunk width and batch.
`-ffp-contract=off` keeps the compiler from fusing a multiply and an add in one place and not
in another. `-fno-trapping-math` lets it compute both sides of a select (no program here reads
the floating-point exception flags), so the exp / tanh loops vectorize; it reorders nothing
and changes no result. The build is keyed by the sources, the flags, the compiler's version and
the CPU's feature flags, so a changed machine or source rebuilds. Each op has its torch
reference in `muser.ops.ref` (the draw's: `muser.sampler.gumbel_argmax`; the bands':
`muser.sampler.top_p_bands`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from muser.env import c_compiler, cache_dir
from muser.ops.native.build import INSTALL, NativeUnavailable, build
from muser.ops.packed import PackedMatrix

SOURCES = [Path(__file__).with_name(name)
           for name in ("gemm.c", "norms.c", "attention.c", "noise.c", "bands.c")]
HEADERS = [Path(__file__).with_name(name) for name in ("exp.h", "vec.h")]
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp", "-shared",
         "-fPIC"]
# element types: FMT_* of weights in gemm.c, KV_* of the cache in attention.c
FORMATS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
FMT_CODES = 3  # float32 scales; FMT_CODES + 1: float16 scales
FMT_PACKED = {4: 6, 5: 7}  # codes held at 4 bits (FMT_Q4_M) or 5 bits (FMT_Q5_H), by width


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _stderr(line: str) -> None:
    print(f"muser: {line}", file=sys.stderr, flush=True)


def _target() -> tuple[str, Path]:
    """(compiler, the library's path in the cache): keyed by the sources, the flags, the
    compiler's version and the CPU's feature flags."""
    cc = c_compiler()
    if shutil.which(cc) is None:
        raise NativeUnavailable(f"no C compiler '{cc}' (from CC, else cc) on PATH: {INSTALL}")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                             check=False).stdout
    key = hashlib.sha256("\0".join(
        [*(src.read_text() for src in SOURCES + HEADERS), " ".join(FLAGS), version, _cpu_flags(),
         platform.machine()]
    ).encode()).hexdigest()[:16]
    return cc, cache_dir() / "native" / f"muser-cpu-{key}.so"


def is_built() -> bool:
    """Whether this machine's library is in the cache (False: the next use builds it)."""
    return _target()[1].exists()


def build_kernels(report: Callable[[str], None] = _stderr) -> Path:
    """Build this machine's library into the cache unless it is there, each step reported to
    `report` (build.py) -> its path."""
    cc, target = _target()
    if not target.exists():
        report("building CPU kernels for this machine (once)")
        build(cc, FLAGS, SOURCES, target, report)
    return target


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded kernel library, built on first use (announced on stderr) unless a startup
    built it first (muser/startup/start.py)."""
    lib = ctypes.CDLL(str(build_kernels()))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    f32, c_int = ctypes.c_float, ctypes.c_int
    lib.muser_gemm.argtypes = [p, i64, i64, i64, p, c_int, p, p, i64, i64, p, i64, c_int]
    lib.muser_attention.argtypes = [p, i64, i64, i64, i64, i64, p, p, c_int, i64, i64, i64, p,
                                    i64, i64, i64, i64, i64, i64, f32, c_int, p]
    lib.muser_decode_attention.argtypes = [p, i64, i64, i64, i64, i64, p, p, c_int, i64, i64,
                                           i64, p, i64, i64, p, p, p, f32, c_int, p]
    lib.muser_rms_norm.argtypes = [p, i64, i64, i64, p, f32, p]
    lib.muser_add_rms_norm.argtypes = [p, p, i64, i64, p, p, f32, p, p]
    lib.muser_qk_norm_rope.argtypes = [p, i64, i64, i64, i64, i64, p, p, p, f32, p]
    lib.muser_rope_cos_sin.argtypes = [p, i64, p, i64, p, p]
    lib.muser_geglu.argtypes = [p, i64, i64, p]
    lib.muser_gumbel_argmax.argtypes = [p, i64, p, i64, p, i64, i64, i64, p, p, c_int, p]
    lib.muser_top_p_bands.argtypes = [p, i64, p, p]
    lib.muser_isa.argtypes, lib.muser_isa.restype = [], ctypes.c_char_p
    lib.muser_gemm.restype = lib.muser_attention.restype = c_int
    lib.muser_decode_attention.restype = c_int
    for fn in (lib.muser_rms_norm, lib.muser_add_rms_norm, lib.muser_qk_norm_rope,
               lib.muser_rope_cos_sin, lib.muser_geglu, lib.muser_gumbel_argmax,
               lib.muser_top_p_bands):
        fn.restype = None
    return lib


def isa() -> str:
    """The vector build the library was compiled to: "avx512", "avx2" or "portable"."""
    return library().muser_isa().decode()


def cpu_flags() -> list[str]:
    """The vector ISA flags this CPU advertises (/proc/cpuinfo), those a build may use."""
    have = set(_cpu_flags().partition(":")[2].split())
    return sorted(f for f in have if f.startswith(("avx", "amx", "fma", "f16c", "sse4")))


def _check(rc: int, what: str) -> None:
    if rc == -2:
        raise MemoryError(f"{what}: the CPU kernel could not allocate its scratch memory")
    if rc != 0:
        raise ValueError(f"{what}: arguments the CPU kernel does not take")


def gemm(x: torch.Tensor, w: PackedMatrix) -> torch.Tensor:
    """x: [N, K] float32 (unit inner stride) -> x @ W.T: [N, M] float32, each output one FMA
    chain along k in order (gemm.c), whatever N."""
    assert x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1
    n, k = x.shape
    m = w.rows
    assert w.shape[1] == k, (tuple(x.shape), w.shape)
    y = torch.empty(n, m, dtype=torch.float32)
    if n == 0:
        return y
    if w.bits != 8:
        fmt = FMT_PACKED[w.bits]
    elif w.is_codes:
        fmt = FMT_CODES + (w.scales.dtype == torch.float16)
    else:
        fmt = FORMATS[w.data.dtype]
    rc = library().muser_gemm(
        x.data_ptr(), n, k, x.stride(0), w.data.data_ptr(), fmt,
        None if w.scales is None else w.scales.data_ptr(),
        None if w.mins is None else w.mins.data_ptr(), w.group, m, y.data_ptr(), m,
        torch.get_num_threads())
    if rc:  # the message formatted only when there is one: a decode step makes 70 calls
        _check(rc, f"gemm of {tuple(x.shape)} by {w.shape}")
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


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [N] int64, inv_freq: [half] float32 -> (cos, sin) [N, half] float32 of
    float(position) * inv_freq, each row on its own."""
    positions, inv_freq = positions.long().contiguous(), inv_freq.float().contiguous()
    n, half = positions.shape[0], inv_freq.shape[0]
    cos, sin = torch.empty(n, half), torch.empty(n, half)
    library().muser_rope_cos_sin(positions.data_ptr(), n, inv_freq.data_ptr(), half,
                                 cos.data_ptr(), sin.data_ptr())
    return cos, sin


def geglu(x: torch.Tensor) -> torch.Tensor:
    """x: [N, 2 * I] float32 (gate first) -> gelu_tanh(gate) * up: [N, I] float32."""
    x = x.contiguous()
    assert x.dtype == torch.float32 and x.shape[1] % 2 == 0
    n, d = x.shape[0], x.shape[1] // 2
    y = torch.empty(n, d)
    library().muser_geglu(x.data_ptr(), n, d, y.data_ptr())
    return y


def gumbel_argmax(values: torch.Tensor, ids: torch.Tensor, keep: torch.Tensor,
                  keys: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """The sampler's draw in one pass (noise.c): values [B, W] float32, ids [B, W] int64, keep
    [B, W] bool (each with unit inner stride; rows may share storage), keys [B] int64,
    temperature [B] float64 -> [B] int64, each row's id of the largest
    value / temperature + Gumbel noise among its kept ones."""
    assert values.dtype == torch.float32 and ids.dtype == keys.dtype == torch.int64
    assert keep.dtype == torch.bool and temperature.dtype == torch.float64
    assert values.shape == ids.shape == keep.shape and values.dim() == 2
    assert values.stride(1) == ids.stride(1) == keep.stride(1) == 1
    rows, width = values.shape
    keys, temperature = keys.contiguous(), temperature.contiguous()
    out = torch.empty(rows, dtype=torch.int64)
    library().muser_gumbel_argmax(values.data_ptr(), values.stride(0), ids.data_ptr(),
                                  ids.stride(0), keep.data_ptr(), keep.stride(0), rows, width,
                                  keys.data_ptr(), temperature.data_ptr(),
                                  torch.get_num_threads(), out.data_ptr())
    return out


def top_p_bands(relative: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """relative [V] float32 in [0, 1] -> each power-of-two band's mass [127] float64 and
    count [127] int64 in one pass (bands.c)."""
    assert relative.dtype == torch.float32 and relative.dim() == 1
    relative = relative.contiguous()
    mass = torch.empty(127, dtype=torch.float64)
    count = torch.empty(127, dtype=torch.int64)
    library().muser_top_p_bands(relative.data_ptr(), relative.numel(), mass.data_ptr(),
                                count.data_ptr())
    return mass, count


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, last0: int, first_min: int,
    window: int | None, scale: float, placement: tuple[torch.Tensor, int, int] | None = None,
) -> torch.Tensor:
    """q: [T, H, D] float32 (unit inner stride); k, v: key rows [R, KVH, D] of one dtype,
    float32, float16 or bfloat16 (widened exactly as read), with equal strides. Query t sees
    key indices [max(first_min, last0 + t - window + 1), last0 + t];
    key index i is row i, or, with placement = (block_table [blocks] int32, block_size,
    origin), the row ref.decode_rows gives. -> [T, H, D] float32 (attention.c)."""
    t, heads, d = q.shape
    kv_heads = k.shape[1]
    assert q.dtype == torch.float32 and k.dtype == v.dtype and k.stride() == v.stride()
    assert q.stride(2) == 1 and k.stride(2) == 1 and heads % kv_heads == 0
    out = torch.empty(t, heads, d)
    table, block_size, origin = (None, 0, 0) if placement is None else placement
    if table is not None:
        assert table.dtype == torch.int32 and table.is_contiguous()
    _check(library().muser_attention(
        q.data_ptr(), t, heads, d, q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(),
        FORMATS[k.dtype], k.stride(0), k.stride(1), kv_heads,
        None if table is None else table.data_ptr(),
        0 if table is None else table.shape[0], block_size, origin, last0, first_min,
        window or 0, scale, torch.get_num_threads(), out.data_ptr()), "attention")
    return out


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor,
    starts: torch.Tensor, lens: torch.Tensor, origins: torch.Tensor, block_size: int,
    scale: float,
) -> torch.Tensor:
    """One decode row a sequence: q [B, H, D] float32 (unit inner stride); k, v: cache rows
    [R, KVH, D] as attention() takes them; tables [B, blocks], starts, lens, origins [B] int32
    (the step plan's own: nothing is converted per layer). Row b sees key indices
    [starts[b], lens[b]) placed as ref.decode_rows places them (zero when it sees none) ->
    [B, H, D] float32: attention() of each row, the sequences shared out among the threads
    (attention.c)."""
    b, heads, d = q.shape
    assert q.dtype == torch.float32 and k.dtype == v.dtype and k.stride() == v.stride()
    assert q.stride(2) == 1 and k.stride(2) == 1 and heads % k.shape[1] == 0
    tables, starts, lens, origins = (t.to(torch.int32).contiguous()
                                     for t in (tables, starts, lens, origins))
    out = torch.empty(b, heads, d)
    _check(library().muser_decode_attention(
        q.data_ptr(), b, heads, d, q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(),
        FORMATS[k.dtype], k.stride(0), k.stride(1), k.shape[1], tables.data_ptr(),
        tables.shape[1], block_size, starts.data_ptr(), lens.data_ptr(), origins.data_ptr(),
        scale, torch.get_num_threads(), out.data_ptr()), "decode attention")
    return out
