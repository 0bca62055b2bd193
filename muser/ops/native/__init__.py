"""Compiled CPU kernels: C sources beside this file, built once per machine with the system C
compiler (`$CC`, else `cc`) into muser's cache, and called through ctypes.

The build is keyed by the source, the flags, the compiler's version and the CPU's feature
flags, so a changed machine or source rebuilds. Nothing here runs unless the CPU decode path
asks for packed weights.
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

SOURCE = Path(__file__).with_name("qgemv.c")
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
        proc = subprocess.run([cc, *FLAGS, "-o", str(out), str(SOURCE)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise NativeUnavailable(f"building {SOURCE.name} with {cc} failed:\n"
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
        [SOURCE.read_text(), " ".join(FLAGS), version, _cpu_flags(), platform.machine()]
    ).encode()).hexdigest()[:16]
    target = cache_dir() / "native" / f"qgemv-{key}.so"
    if not target.exists():
        _build(cc, target)
    lib = ctypes.CDLL(str(target))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.muser_qgemv.argtypes = [p, i64, i64, p, p, p, p, i64, i64, p, ctypes.c_int]
    lib.muser_qgemv.restype = ctypes.c_int
    return lib


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
