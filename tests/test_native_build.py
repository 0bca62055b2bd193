"""The CPU kernels' one-time build (muser/ops/native/build.py): a compiler process a source,
every step on the screen, and a missing compiler or OpenMP named with what to install."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

from muser.ops import native
from muser.ops.native.build import NativeUnavailable, build


def test_missing_compiler_names_what_to_install(gguf_path: Path, tmp_path: Path) -> None:
    """A fresh cache and CC naming no binary: `muser generate` stops with one line saying
    which compiler is missing and what to install, before it builds anything."""
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"),
           "MUSER_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "muser", "generate", "hi", "--model",
                           str(gguf_path), "--device", "cpu", "--max-tokens", "1"],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode != 0
    assert f"no C compiler '{tmp_path / 'no-such-cc'}'" in proc.stderr
    assert "apt-get install gcc" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "cache" / "native").exists()


def test_compiler_without_openmp_is_named(tmp_path: Path) -> None:
    """A compiler that refuses -fopenmp (clang without its OpenMP runtime answers so): the
    error says OpenMP is what is missing."""
    cc = tmp_path / "cc-no-openmp"
    cc.write_text('#!/bin/sh\nfor a; do [ "$a" = -fopenmp ] && '
                  '{ echo "error: unsupported option \'-fopenmp\'" >&2; exit 1; }; done\n'
                  'exec cc "$@"\n')
    cc.chmod(0o755)
    with pytest.raises(NativeUnavailable, match="cannot build an OpenMP library") as err:
        build(str(cc), native.FLAGS, native.SOURCES[-1:], tmp_path / "lib.so", print)
    assert "libomp-dev" in str(err.value) and "unsupported option" in str(err.value)
    assert not (tmp_path / "lib.so").exists()


def test_sources_compile_side_by_side_and_report(tmp_path: Path) -> None:
    """Two sources, two compiler processes at once (each slowed to 1 s: the line while they
    run names both), a line as each ends; the linked library exports both sources' functions."""
    cc = tmp_path / "slow-cc"
    cc.write_text('#!/bin/sh\ncase " $* " in *" -c "*) sleep 1;; esac\nexec cc "$@"\n')
    cc.chmod(0o755)
    sources = [s for s in native.SOURCES if s.name in ("noise.c", "bands.c")]
    lines: list[str] = []
    build(str(cc), native.FLAGS, sources, tmp_path / "lib.so", lines.append, jobs=2,
          heartbeat=0.3)
    assert lines[0] == "compiling 2 sources, 2 at a time"
    assert any(line.startswith("still compiling") and "noise.c" in line and "bands.c" in line
               for line in lines)
    assert {line.split()[1] for line in lines if line.startswith("compiled ")} == {
        "noise.c", "bands.c"}
    assert lines[-1].startswith("built lib.so in ")
    lib = ctypes.CDLL(str(tmp_path / "lib.so"))
    assert lib.muser_gumbel_argmax and lib.muser_top_p_bands


def test_failed_source_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.c"
    bad.write_text("int broken(void) { return }\n")
    with pytest.raises(NativeUnavailable, match="compiling bad.c with cc failed"):
        build("cc", native.FLAGS, [bad, *native.SOURCES[-1:]], tmp_path / "lib.so",
              lambda line: None)
    assert not (tmp_path / "lib.so").exists()
