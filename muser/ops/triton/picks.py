"""Kernel picks on disk: what the projections chose per shape key, as JSON, in the tuning cache
of this machine's fingerprint (`muser/ops/tuning_cache.py`), plus a table shipped with the package.

Four families of picks, each its module's:
- "linear" (`linear.py`, dense weights): key `linear._key`'s tuple (rows or row bucket, M, K,
  epilogue, weight dtype, input dtype) written "rows|M|K|epilogue|wdtype|xdtype"; pick
  "cublas", {"gemv": {...}} or {"gemm": {...}};
- "fp8" (`linear_fp8.py`, Fp8Matrix weights): the same key after "fp8|"; pick "scaled_mm",
  "dequant" (more than MAX_ROWS rows, weights not bfloat16) or {"gemv": {...}} (FP8 GEMV
  kinds, up to MAX_ROWS);
- "blocks" (`block_weights.py`, GGUF blocks): key (rows, M, K, block type, input dtype) written
  "blocks|rows|M|K|Q4_K|xdtype"; pick {"block_gemv": {...}};
- "blocks_exact" (`block_weights.py`, GGUF blocks on the exact route, up to DOT_ROWS rows): key
  (rows, M, K, block type, input dtype, engine dtype, cut) written
  "blocks_exact|rows|M|K|Q4_K|xdtype|dtype|cut"; pick {"gemv": {...}} of the "dot" kind.
An entry is {"config": <pick>, "timed_ms": {...}}; one that does not parse into a known config
of the right kind for its key is ignored with a warning.

`picks_h200.json` ships picks measured on an H200 by `scripts/make_tuning_table.py` for the
presets. It is read when this GPU has the same name, for keys the cache lacks: a pick is only a
choice among configs that are all correct, so under other versions it can cost speed, never
correctness; `muser tune` measures this machine's own.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import torch
import triton
from gguf import GGMLQuantizationType

from muser.env import cache_dir, shipped_picks
from muser.ops.fp8 import chunk_route
from muser.ops.triton.gemm import GemmConfig
from muser.ops.triton.gemv import DOT_ROWS, MAX_ROWS, GemvConfig
from muser.ops.triton.gemv_blocks import BlockGemvConfig
from muser.ops.tuning_cache import TuningCache, read_fingerprint, read_picks

Pick = GemvConfig | GemmConfig | BlockGemvConfig | str | None  # None: cuBLAS
Family = dict[tuple, tuple[Pick, dict]]  # key -> (pick, timed_ms)
FAMILIES = ("linear", "fp8", "blocks", "blocks_exact")
_GEMV_KINDS = {"linear": ("fma", "dot"), "fp8": ("fma", "dot", "dot8", "row"),
               "blocks_exact": ("dot",)}
SHIPPED = Path(__file__).with_name("picks_h200.json")
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.bfloat16, torch.float16,
                                                     torch.float32, torch.float8_e4m3fn)}


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
    return TuningCache.at(cache_dir(), fingerprint(device))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def key_text(key: tuple, family: str = "linear") -> str:
    if family == "blocks":
        rows, m, k, qtype, x_dtype = key
        fields = ("blocks", rows, m, k, GGMLQuantizationType(qtype).name, _name(x_dtype))
    elif family == "blocks_exact":
        rows, m, k, qtype, x_dtype, dtype, cut = key
        fields = (family, rows, m, k, GGMLQuantizationType(qtype).name, _name(x_dtype),
                  _name(dtype), cut)
    else:
        rows, m, k, epilogue, w_dtype, x_dtype = key
        fields = (rows, m, k, epilogue, _name(w_dtype), _name(x_dtype))
        fields = ("fp8", *fields) if family == "fp8" else fields
    return "|".join(map(str, fields))


def parse_key(text: str) -> tuple[str, tuple]:
    """-> (family, key)."""
    fields = text.split("|")
    family = fields[0] if fields[0] in FAMILIES else "linear"
    fields = fields[1:] if family != "linear" else fields
    if family == "blocks":
        rows, m, k, qtype, x_dtype = fields
        return family, (int(rows), int(m), int(k), GGMLQuantizationType[qtype], _DTYPES[x_dtype])
    if family == "blocks_exact":
        rows, m, k, qtype, x_dtype, dtype, cut = fields
        return family, (int(rows), int(m), int(k), GGMLQuantizationType[qtype],
                        _DTYPES[x_dtype], _DTYPES[dtype], int(cut))
    rows, m, k, epilogue, w_dtype, x_dtype = fields
    if epilogue not in ("", "geglu", "norm", "exact", "exact+geglu", "exact+norm"):
        raise ValueError(f"unknown epilogue {epilogue!r}")
    return family, (int(rows), int(m), int(k), epilogue, _DTYPES[w_dtype], _DTYPES[x_dtype])


def config_json(pick: Pick) -> Any:
    if pick is None:
        return "cublas"
    if isinstance(pick, str):
        return pick
    kind = {GemvConfig: "gemv", GemmConfig: "gemm", BlockGemvConfig: "block_gemv"}[type(pick)]
    return {kind: dataclasses.asdict(pick)}


def parse_config(obj: Any, rows: int, family: str = "linear", exact: bool = False) -> Pick:
    """A stored pick of `family` for `rows` rows (GEMVs up to MAX_ROWS, or DOT_ROWS on the
    exact route; GEMM or a dense route above)."""
    decode = rows <= (DOT_ROWS if exact or family == "blocks_exact" else MAX_ROWS)
    if family == "linear" and obj == "cublas":
        return None  # NOTE: parse_entries refuses it for an exact key
    if family == "fp8" and (obj == "scaled_mm" or (obj == "dequant" and not decode)):
        return obj
    kind, fields = next(iter(obj.items())) if isinstance(obj, dict) and len(obj) == 1 else (
        None, None)
    allowed = {"linear": {"gemv": GemvConfig, "gemm": GemmConfig}, "fp8": {"gemv": GemvConfig},
               "blocks": {"block_gemv": BlockGemvConfig},
               "blocks_exact": {"gemv": GemvConfig}}[family]
    cls = allowed.get(kind)
    if cls is None or (cls is GemmConfig) == decode:
        raise ValueError(f"not a {family} pick for {rows} rows: {obj!r}")
    pick = cls(**fields)
    if any(not isinstance(v, int) or v < 1 for v in dataclasses.astuple(pick)
           if not isinstance(v, (str, bool))):
        raise ValueError(f"bad sizes in {obj!r}")
    if isinstance(pick, GemvConfig) and pick.kind not in _GEMV_KINDS[family]:
        raise ValueError(f"unknown GEMV kind in {obj!r}")
    if isinstance(pick, GemvConfig) and pick.kind == "row" and rows != 1:
        raise ValueError(f"a one-row GEMV loop for {rows} rows: {obj!r}")
    return pick


def parse_entries(entries: dict[str, Any], origin: Path) -> dict[str, Family]:
    """Stored entries -> {family: {key: (pick, timed_ms)}} (every family present); bad entries
    are skipped with a warning."""
    out: dict[str, Family] = {f: {} for f in FAMILIES}
    bad = []
    for text, entry in entries.items():
        try:
            family, key = parse_key(text)
            exact = family == "linear" and key[3].startswith("exact")
            pick = parse_config(entry["config"], key[0], family, exact)
            if exact and not (
                    isinstance(pick, GemmConfig) or getattr(pick, "kind", None) == "dot"):
                raise ValueError("the exact route runs tensor-core GEMVs and GEMMs only")
            if family == "fp8" and key[0] > MAX_ROWS and pick != chunk_route(key[4], *key[1:3]):
                raise ValueError("an FP8 chunk runs the route fp8.chunk_route names")
            out[family][key] = (pick, dict(entry.get("timed_ms", {})))
        except (KeyError, TypeError, ValueError, AttributeError, StopIteration):
            bad.append(text)
    if bad:
        warnings.warn(f"ignoring {len(bad)} bad entries of {origin} (first: {bad[0]!r})",
                      stacklevel=2)
    return out


def load(device: torch.device) -> tuple[dict[str, Family], dict[str, Family]]:
    """-> (this machine's stored picks, the shipped table's when this GPU has its name), each
    {family: {key: (pick, timed_ms)}}."""
    store = cache(device)
    shipped = shipped_picks(SHIPPED)
    same_gpu = read_fingerprint(shipped).get("gpu") == store.fingerprint["gpu"]
    return (parse_entries(store.load(), store.path),
            parse_entries(read_picks(shipped, None) if same_gpu else {}, shipped))


def entries(measured: dict[str, Family]) -> dict[str, Any]:
    """{family: {key: (pick, timed_ms)}} -> the stored entries."""
    return {key_text(k, family): {"config": config_json(p), "timed_ms": t}
            for family, picks in measured.items() for k, (p, t) in picks.items()}


def save(device: torch.device, measured: dict[str, Family]) -> Path:
    """Store measured picks in this machine's tuning cache -> its path."""
    store = cache(device)
    store.save(entries(measured))
    return store.path
