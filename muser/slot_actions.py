"""Slot actions (llama-server's `POST /slots/{id}?action=save|restore|erase`), run on the
engine's thread between steps.

A slot in muser holds a sequence only while a request runs; when it finishes, its rows stay in
the prefix cache (muser/kvcache/reuse.py: full pages under their prefix keys, the rings and the
partial page in a checkpoint) and the engine remembers which token ids the slot's last sequence
left there (Engine.slot_ids): that is what llama-server calls the slot's cache.

    save ..... looks those ids up in the prefix cache (the lookup a prompt makes, into a spare
               slot), copies the rows out (muser/kvcache/snapshot.py's export) and writes a slot
               file (muser/kvcache/slot_file.py)
    restore .. reads and checks a slot file, installs it in a spare slot and fresh pages (the
               install a remote prefill gets) and frees that sequence at once: its rows enter
               the prefix cache as a finished request's would, so the next prompt that begins
               with them, in any slot, starts after them; the slot now names those ids
    erase .... forgets the slot's ids from the prefix cache (checkpoints along them and the
               pages under their keys), so the same prompt computes all its rows again

Restoring into the prefix cache rather than pinning the rows to one slot keeps a single path by
which a prompt finds earlier KV; the rows are then evicted like any cached prefix (LRU) when
pages run out.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from muser.engine import Engine
from muser.errors import MuserError
from muser.kvcache import slot_file
from muser.kvcache.pages import OutOfPages
from muser.kvcache.snapshot import export, install


class SlotError(MuserError):
    """An action that cannot be done: an HTTP status, a message and a code for the answer."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class SlotActions:
    def __init__(self, engine: Engine, folder: str | None,
                 fingerprint: Callable[[], str]) -> None:
        """folder: --slot-save-path (None: save and restore are refused); fingerprint: the
        model's, computed when first needed (a pass over the model file)."""
        self.engine, self.folder, self._fingerprint = engine, folder, fingerprint

    def __call__(self, action: str, slot: int, filename: str | None = None) -> dict[str, Any]:
        """Raises SlotError."""
        if action == "erase":
            return self.erase(slot)
        self._check(slot)
        path = self._path(filename)
        return self.save(slot, path, filename) if action == "save" else self.restore(
            slot, path, filename)

    def save(self, slot: int, path: str, filename: str) -> dict[str, Any]:
        runner, start = self.engine.runner, time.perf_counter()
        ids = self.engine.slot_ids.get(slot)
        if not ids:
            raise SlotError(400, f"slot {slot} holds no KV to save (no request has finished "
                            "in it since it was last erased)", "slot_empty")
        seq = runner.allocate(ids + [0], count=False)  # NOTE: + one: ids[:-1] would be looked up
        try:
            if seq.num_cached < len(ids):
                raise SlotError(409, f"slot {slot}'s KV has left the prefix cache (pages "
                                f"reused for other prompts): {seq.num_cached} of its "
                                f"{len(ids)} tokens are still cached", "slot_evicted")
            snap = export(runner, seq, torch.empty(0))
        finally:
            runner.free(seq)
        try:
            written = slot_file.write(path, self._fingerprint(), ids, snap)
        except OSError as exc:
            raise SlotError(500, f"cannot write slot file {filename!r}: {exc.strerror}",
                            "write_failed") from None
        return {"id_slot": slot, "filename": filename, "n_saved": len(ids),
                "n_written": written, "timings": {"save_ms": _ms(start)}}

    def restore(self, slot: int, path: str, filename: str) -> dict[str, Any]:
        runner, start = self.engine.runner, time.perf_counter()
        pool, cfg = runner.pool, runner.cfg
        # NOTE: the row as the pool holds it (an FP8 cache's packed rows: muser/ops/kv_fp8.py)
        shape = (len(cfg.layers_of("sliding")), len(cfg.layers_of("global")),
                 *pool.rows(0)[0].shape[1:])
        try:
            ids, snap, read = slot_file.read(path, self._fingerprint(), pool.dtype, shape)
        except FileNotFoundError:
            raise SlotError(404, f"no slot file {filename!r} in --slot-save-path",
                            "not_found") from None
        except OSError as exc:
            why = "is a symlink" if exc.errno == errno.ELOOP else exc.strerror
            raise SlotError(400, f"slot file {filename!r}: {why}", "invalid_filename") from None
        except slot_file.SlotFileError as exc:
            raise SlotError(400, f"slot file {filename!r}: {exc}", "invalid_slot_file") from None
        if len(ids) >= self.engine.max_model_len:
            raise SlotError(400, f"slot file {filename!r} holds {len(ids)} tokens; this "
                            f"server's context holds {self.engine.max_model_len}",
                            "invalid_slot_file")
        try:
            seq = install(runner, snap, ids)
        except (OutOfPages, RuntimeError) as exc:
            raise SlotError(503, f"no room to restore {len(ids)} tokens now ({exc}); retry "
                            "when requests finish", "busy") from None
        except ValueError as exc:
            raise SlotError(400, f"slot file {filename!r}: {exc}", "invalid_slot_file") from None
        runner.free(seq)
        self.engine.slot_ids[slot] = ids
        return {"id_slot": slot, "filename": filename, "n_restored": len(ids),
                "n_read": read, "timings": {"restore_ms": _ms(start)}}

    def erase(self, slot: int) -> dict[str, Any]:
        """(A request running in the slot was aborted just before.)"""
        ids = self.engine.slot_ids.pop(slot, [])
        if ids and self.engine.runner.prefix is not None:
            self.engine.runner.prefix.forget(ids)
        return {"id_slot": slot, "n_erased": len(ids)}

    def _check(self, slot: int) -> None:
        runner = self.engine.runner
        if self.folder is None:
            raise SlotError(501, "This server does not support slots action. Start it with "
                            "`--slot-save-path`", "not_supported")
        if runner.prefix is None or not runner.prefix.index.capacity:
            raise SlotError(501, "slot files need the prefix cache (this server runs with "
                            "--no-prefix-cache or --prefix-cache-gb 0)", "not_supported")
        if any(seq.slot == slot for seq in self.engine.live.values()):
            raise SlotError(409, f"slot {slot} is processing a request; retry when it is idle",
                            "slot_busy")
        if not runner.free_slots:
            raise SlotError(503, "every sequence slot is busy; retry when a request finishes",
                            "busy")

    def _path(self, filename: str | None) -> str:
        """The file inside the folder (the server checked the name; checked again here)."""
        if not filename or os.path.basename(filename) != filename or filename in (".", ".."):
            raise SlotError(400, "Invalid filename", "invalid_filename")
        return os.path.join(self.folder, filename)


def _ms(start: float) -> float:
    return round((time.perf_counter() - start) * 1000, 3)
