"""Projection picks on disk: what `linear` chose per shape key, as JSON, in the tuning cache of
this machine's fingerprint (`muser/tuning_cache.py`), plus a table shipped with the package.

A key is `linear._key`'s tuple (rows or row bucket, M, K, epilogue, weight dtype, input dtype)
written as "rows|M|K|epilogue|wdtype|xdtype"; an entry is {"config": <pick>, "timed_ms": {...}}
with the pick "cublas", {"gemv": {...}} or {"gemm": {...}}. An entry that does not parse into a
known config of the right kind for its key is ignored with a warning.

`picks_h200.json` ships picks measured on an H200 by `scripts/make_tuning_table.py` for the
presets. It is read when this GPU has the same name, for keys the cache lacks: a pick is only a
choice among configs that are all correct, so under other versions it can cost speed, never
correctness; `muser tune` measures this machine's own.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import triton

from muser.ops.triton.gemm import GemmConfig
from muser.ops.triton.gemv import MAX_ROWS, GemvConfig
from muser.tuning_cache import TuningCache, read_fingerprint, read_picks

Pick = GemvConfig | GemmConfig | None  # None: cuBLAS
SHIPPED = Path(__file__).with_name("picks_h200.json")
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.bfloat16, torch.float16,
                                                     torch.float32)}


def fingerprint(device: torch.device) -> dict[str, str]:
    """GPU name, driver, CUDA, torch and triton versions: what a measured pick depends on."""
    return {"gpu": torch.cuda.get_device_name(device), "driver": _driver_version(),
            "cuda": str(torch.version.cuda), "torch": torch.__version__,
            "triton": triton.__version__}


def _driver_version() -> str:
    try:
        with open("/proc/driver/nvidia/version") as f:
            line = f.readline()
    except OSError:
        return str(torch._C._cuda_getDriverVersion())
    words = [w for w in line.split() if w[:1].isdigit() and "." in w]
    return words[0] if words else str(torch._C._cuda_getDriverVersion())


def cache(device: torch.device) -> TuningCache:
    from muser.loading.default_model import cache_dir

    return TuningCache.at(cache_dir(), fingerprint(device))


def key_text(key: tuple) -> str:
    rows, m, k, epilogue, w_dtype, x_dtype = key
    return "|".join(map(str, (rows, m, k, epilogue, *(str(d).removeprefix("torch.")
                                                      for d in (w_dtype, x_dtype)))))


def parse_key(text: str) -> tuple:
    rows, m, k, epilogue, w_dtype, x_dtype = text.split("|")
    if epilogue not in ("", "geglu", "norm"):
        raise ValueError(f"unknown epilogue {epilogue!r}")
    return int(rows), int(m), int(k), epilogue, _DTYPES[w_dtype], _DTYPES[x_dtype]


def config_json(pick: Pick) -> Any:
    if pick is None:
        return "cublas"
    return {"gemv" if isinstance(pick, GemvConfig) else "gemm": dataclasses.asdict(pick)}


def parse_config(obj: Any, rows: int) -> Pick:
    """A stored pick for `rows` rows (decode GEMV up to MAX_ROWS, GEMM above)."""
    if obj == "cublas":
        return None
    kind, fields = next(iter(obj.items())) if isinstance(obj, dict) and len(obj) == 1 else (
        None, None)
    cls = {"gemv": GemvConfig, "gemm": GemmConfig}.get(kind)
    if cls is None or (cls is GemvConfig) != (rows <= MAX_ROWS):
        raise ValueError(f"not a pick for {rows} rows: {obj!r}")
    pick = cls(**fields)
    if any(not isinstance(v, int) or v < 1 for v in dataclasses.astuple(pick)
           if not isinstance(v, (str, bool))):
        raise ValueError(f"bad sizes in {obj!r}")
    if isinstance(pick, GemvConfig) and pick.kind not in ("fma", "dot"):
        raise ValueError(f"unknown GEMV kind in {obj!r}")
    return pick


def parse_entries(entries: dict[str, Any], origin: Path) -> dict[tuple, tuple[Pick, dict]]:
    """Stored entries -> {key: (pick, timed_ms)}; bad entries are skipped with a warning."""
    out, bad = {}, []
    for text, entry in entries.items():
        try:
            key = parse_key(text)
            out[key] = (parse_config(entry["config"], key[0]), dict(entry.get("timed_ms", {})))
        except (KeyError, TypeError, ValueError, AttributeError, StopIteration):
            bad.append(text)
    if bad:
        warnings.warn(f"ignoring {len(bad)} bad entries of {origin} (first: {bad[0]!r})",
                      stacklevel=2)
    return out


def load(device: torch.device) -> tuple[dict[tuple, tuple[Pick, dict]],
                                         dict[tuple, tuple[Pick, dict]]]:
    """-> (this machine's stored picks, the shipped table's when this GPU has its name), each
    {key: (pick, timed_ms)}."""
    store = cache(device)
    shipped = Path(os.environ.get("MUSER_SHIPPED_PICKS", SHIPPED))
    same_gpu = read_fingerprint(shipped).get("gpu") == store.fingerprint["gpu"]
    return (parse_entries(store.load(), store.path),
            parse_entries(read_picks(shipped, None), shipped) if same_gpu else {})


def save(device: torch.device, picks: dict[tuple, tuple[Pick, dict]]) -> Path:
    """Store measured picks in this machine's tuning cache -> its path."""
    store = cache(device)
    store.save({key_text(k): {"config": config_json(p), "timed_ms": t}
                for k, (p, t) in picks.items()})
    return store.path
