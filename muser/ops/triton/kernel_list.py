"""The kernels a warm-up compiled, kept per machine and configuration, so that the next start
files them in the JIT's in-process cache straight from Triton's disk cache, with no compile
pass over the model:

    <cache dir>/kernels/<gpu>-<hash of the fingerprint>.json
    {"fingerprint": {<the tuning cache's>, "sources": <hash of this package's sources>,
                     "triton env": ..., "config": <model and engine configs, picks>},
     "picks": {"<module>.<kernel> <JIT key>": {"module": ..., "name": ..., "key": <JIT key>,
               "spec": <Triton's specialization data>, "hash": <Triton's cache key>,
               "files": {<file name>: <its path in Triton's cache>}}}}

A kernel is rebuilt as Triton's compile path rebuilds one it finds in its cache (a
`CompiledKernel` over the cached files; the source as `JITFunction.preload` reads it) and filed
under its JIT key, without the rest of that path (which first hashes Triton's own sources and
library, then each kernel's source). The list is written by a warm-up that timed nothing, so it
holds no tuning candidates. An entry whose files are gone, or that names no kernel of this
package, is skipped: the warm-up's run then compiles what the list lacked, and the next save
adds it.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import warnings
from pathlib import Path
from typing import Any

import torch
import triton.language as tl
from triton._C.libtriton import get_cache_invalidating_env_vars
from triton.compiler import ASTSource
from triton.compiler.compiler import CompiledKernel
from triton.runtime.jit import JITFunction, convert_to_tuple_if_list

from muser.env import cache_dir
from muser.ops.triton.picks import fingerprint as machine_fingerprint
from muser.ops.tuning_cache import TuningCache

Compiled = tuple[JITFunction, str, str]  # (kernel, JIT key, specialization data)


def store(device: torch.device, config: str) -> TuningCache:
    """The kernel list of this machine, these sources and `config` (model, engine, picks)."""
    sources = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        sources.update(path.read_bytes())
    fingerprint = {**machine_fingerprint(device), "sources": sources.hexdigest()[:16],
                   "triton env": json.dumps(get_cache_invalidating_env_vars(), sort_keys=True),
                   "config": hashlib.sha256(config.encode()).hexdigest()[:16]}
    return TuningCache.at(cache_dir(), fingerprint, "kernels")


def save(kernels: TuningCache, compiled: list[Compiled], device_index: int) -> int:
    """Add the kernels of `compiled` now in the JIT's cache -> how many were listed."""
    entries = {}
    for fn, key, spec in compiled:
        kernel = fn.device_caches[device_index][0].get(key)
        if isinstance(kernel, CompiledKernel):
            module, name = fn.fn.__module__, fn.fn.__qualname__
            entries[f"{module}.{name} {key}"] = {
                "module": module, "name": name, "key": key, "spec": spec, "hash": kernel.hash,
                "files": dict(kernel.metadata_group)}
    if entries:
        kernels.save(entries)
    return len(entries)


def load(kernels: TuningCache, device_index: int) -> list[CompiledKernel]:
    """File every listed kernel whose files are in Triton's cache in the JIT's cache -> them
    (not yet loaded onto the device)."""
    out, skipped = [], []
    for text, entry in kernels.load().items():
        try:
            out.append(_rebuild(entry, device_index))
        except Exception:  # noqa: BLE001  (a stale or foreign entry: compiled again instead)
            skipped.append(text)
    if skipped:
        warnings.warn(f"{len(skipped)} kernels of {kernels.path} not found or not rebuilt "
                      f"(first: {skipped[0]!r}); the warm-up compiles them", stacklevel=2)
    return out


def _rebuild(entry: dict[str, Any], device_index: int) -> CompiledKernel:
    if not entry["module"].startswith(__package__ + "."):
        raise ValueError(f"not a kernel of {__package__}: {entry['module']}")
    fn = getattr(importlib.import_module(entry["module"]), entry["name"])
    files = {str(k): str(v) for k, v in entry["files"].items()}
    if not isinstance(fn, JITFunction) or not all(Path(p).is_file() for p in files.values()):
        raise FileNotFoundError(entry["name"])
    kernel = CompiledKernel(_source(fn, json.loads(entry["spec"])), files, str(entry["hash"]))
    return fn.device_caches[device_index][0].setdefault(str(entry["key"]), kernel)


def _source(fn: JITFunction, spec: dict[str, Any]) -> ASTSource:
    """The kernel's source as specialized (`JITFunction.preload`'s reading of the data)."""
    constexprs = {
        tuple(k): tl.dtype(v) if tl.dtype.is_dtype(v) else
        tl.constexpr(v["constexpr"]) if isinstance(v, dict) and "constexpr" in v else v
        for k, v in zip(spec["constant_keys"], spec["constant_vals"])}
    attrs = {tuple(k): v for k, v in zip(spec["attrs_keys"], spec["attrs_vals"])}
    signature = {k: convert_to_tuple_if_list(v) for k, v in spec["signature"].items()}
    return ASTSource(fn, signature, constexprs, attrs)
