"""Slot files: one sequence's KV on disk (`POST /slots/{id}?action=save|restore`).

A safetensors file (no pickle: reading one runs no code) holding

    token_ids  int64 [num_tokens]                                       the rows' token ids
    sliding    [sliding layers, 2 (K, V), ring length, kv_heads, head_dim]  the ring's retained
               rows in logical order (muser/kvcache/snapshot.py's KVSnapshot layout)
    full       [full layers, 2, num_tokens, kv_heads, head_dim]           every row

and in its metadata the format and version, the model's fingerprint (muser/loading/
fingerprint.py: a file written by another model, or by another GGUF of the same model, is
refused), the KV dtype and the ring's metadata (capacity, logical and physical origins,
length), so the ring is restored at the physical rows it had.

Files are written to a temporary name in the same directory and renamed over the target, opened
without following a symlink (O_NOFOLLOW), so a reader never sees half a file and a symlink
planted in the directory is never written through.
"""

from __future__ import annotations

import json
import os
import struct

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from muser.errors import MuserError
from muser.kvcache.ring import RingState
from muser.kvcache.snapshot import KVSnapshot

FORMAT, VERSION = "muser-slot", "1"
_RING = ("capacity", "logical_origin", "physical_origin", "length")


class SlotFileError(MuserError):
    """The file is not a slot file of this model (the message says what does not match)."""


def write(path: str, fingerprint: str, token_ids: list[int], snap: KVSnapshot) -> int:
    """Write `snap` of `token_ids` to `path` -> bytes written."""
    meta = {"format": FORMAT, "version": VERSION, "fingerprint": fingerprint,
            "dtype": str(snap.full.dtype).removeprefix("torch."),
            **{k: str(getattr(snap.ring, k)) for k in _RING}}
    data = st_save({"token_ids": torch.tensor(token_ids, dtype=torch.int64),
                    "sliding": snap.sliding.contiguous().cpu(),
                    "full": snap.full.contiguous().cpu()}, metadata=meta)
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    return len(data)


def read(path: str, fingerprint: str, dtype: torch.dtype,
         shape: tuple[int, int, int, int]) -> tuple[list[int], KVSnapshot, int]:
    """A slot file -> (token ids, snapshot, bytes read). `shape`: this model's (sliding layers,
    full layers, kv_heads, head_dim or an FP8 cache's packed row width). Raises SlotFileError naming what does not match, or
    OSError (a symlink: ELOOP)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        data = f.read()
    meta = _metadata(data)
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise SlotFileError(f"not a {FORMAT} v{VERSION} file")
    if meta.get("fingerprint") != fingerprint:
        raise SlotFileError(f"written by another model (fingerprint {meta.get('fingerprint')}; "
                            f"this model's is {fingerprint})")
    want = str(dtype).removeprefix("torch.")
    if meta.get("dtype") != want:
        raise SlotFileError(f"its KV is {meta.get('dtype')}; this server's is {want}")
    try:
        ring = RingState(*(int(meta[k]) for k in _RING))
        tensors = st_load(data)
        ids, sliding, full = tensors["token_ids"], tensors["sliding"], tensors["full"]
    except Exception as exc:  # noqa: BLE001  (safetensors raises its own kinds)
        raise SlotFileError(f"unreadable: {type(exc).__name__}: {exc}") from None
    n = ids.numel()
    num_sliding, num_full, heads, dim = shape
    if not (ids.dtype == torch.int64 and ids.dim() == 1 and n > 0
            and tuple(sliding.shape) == (num_sliding, 2, ring.length, heads, dim)
            and tuple(full.shape) == (num_full, 2, n, heads, dim)
            and 0 <= ring.length <= ring.capacity and ring.logical_end == n
            and sliding.dtype == full.dtype == dtype):
        raise SlotFileError(f"its tensors do not fit this model's KV layout: token_ids "
                            f"{tuple(ids.shape)}, sliding {tuple(sliding.shape)}, full "
                            f"{tuple(full.shape)}, ring {ring}")
    snap = KVSnapshot(n, ring, sliding, full, torch.empty(0))
    return ids.tolist(), snap, len(data)


def _metadata(data: bytes) -> dict[str, str]:
    """The safetensors header's __metadata__ (an 8-byte length, then JSON)."""
    if len(data) < 8:
        raise SlotFileError("not a safetensors file (too short)")
    (size,) = struct.unpack_from("<Q", data)
    try:
        header = json.loads(data[8:8 + size])
    except (ValueError, UnicodeDecodeError):
        raise SlotFileError("not a safetensors file (bad header)") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else {}
