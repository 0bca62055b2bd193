"""Admin routes: GET /slots, POST /slots/{id}?action=save|restore|erase (llama-server's).

Slot actions change state, so a server without --admin-key refuses them (403) unless started
with --keyless-admin. Save and restore name a file inside --slot-save-path: a plain name (no
path separator, no leading dot, no control or reserved character, short enough that the
temporary name the engine writes first, .NAME.PID.tmp, fits the folder's file name limit:
242 bytes where the limit is 255), never a symlink; anything else is refused with 400 before
the engine sees it (and the engine opens files without following symlinks). The action itself
runs in the engine process between two steps (muser/slot_actions.py); its answer has
llama-server's fields.
"""

from __future__ import annotations

import asyncio
import os
import stat
from typing import Any

from fastapi import APIRouter, Request

from muser.server.context import ServerContext
from muser.server.engine_process import EngineDead
from muser.server.errors import ApiError
from muser.server.protocol import SlotFileRequest

router = APIRouter()

ACTIONS = ("save", "restore", "erase")
ACTION_TIMEOUT_S = 300
_RESERVED = set('/\\:*?"<>|')
# NOTE: muser/kvcache/slot_file.py writes ".NAME.PID.tmp" and renames it; a pid has at most
# 7 digits on Linux (PID_MAX_LIMIT = 4194304)
_TMP_NAME_EXTRA = len("..") + 7 + len(".tmp")


def _ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


@router.get("/slots")
async def slots(request: Request) -> list[dict[str, Any]]:
    ctx = _ctx(request)
    if not ctx.options.slots:
        raise ApiError(501, "/slots is disabled: start the server without --no-slots",
                       "not_supported")
    stats = ctx.loop.stats
    by_slot = {s.slot: s for s in stats.slots if s.slot is not None}
    out = []
    for i in range(ctx.max_num_seqs):
        s = by_slot.get(i)
        out.append({"id": i, "id_task": s.uid if s else -1, "is_processing": s is not None,
                    "n_ctx": ctx.max_model_len, "state": s.status if s else "idle",
                    "n_prompt_tokens": s.num_prompt if s else 0,
                    "n_past": s.num_cached if s else 0, "n_decoded": s.num_output if s else 0,
                    "n_cached": stats.slot_cache.get(i, 0),
                    "n_waiting": stats.slot_waiting.get(i, 0)})
    # NOTE: a prompt being prefilled by a prefill worker holds no slot yet: listed after them
    out += [{"id": -1, "id_task": s.uid, "is_processing": True, "n_ctx": ctx.max_model_len,
             "state": s.status, "n_prompt_tokens": s.num_prompt, "n_past": 0, "n_decoded": 0}
            for s in ctx.loop.stats.slots if s.status == "remote"]
    return out


@router.post("/slots/{slot_id}")
async def slot_action(request: Request, slot_id: int, action: str) -> dict[str, Any]:
    """erase: cancels the request running in the slot, then forgets the slot's KV; save /
    restore: the slot's KV to / from a file in --slot-save-path."""
    ctx = _ctx(request)
    if not ctx.keys.admin and not ctx.options.keyless_admin:
        raise ApiError(403, "slot actions write files and cancel requests: start the server "
                       "with --admin-key (or --keyless-admin to allow them without a key)",
                       "admin_disabled")
    if action not in ACTIONS:
        raise ApiError(400, f"Invalid action {action!r}: one of {', '.join(ACTIONS)}",
                       "invalid_value", "action")
    if not 0 <= slot_id < ctx.max_num_seqs:
        raise ApiError(404, f"no slot {slot_id} (slots 0 to {ctx.max_num_seqs - 1})",
                       "not_found", "id_slot")
    filename = None
    if action != "erase":
        folder = ctx.options.slot_save_path
        if folder is None:
            raise ApiError(501, "This server does not support slots action. Start it with "
                           "`--slot-save-path`", "not_supported")
        filename = (await ctx.read_body(request, SlotFileRequest)).filename
        _check_file(folder, filename, must_exist=action == "restore")
    else:
        for s in ctx.loop.stats.slots:
            if s.slot == slot_id:
                ctx.loop.abort(s.uid)
    try:
        fut = ctx.loop.slot_action(action, slot_id, filename)
    except EngineDead as exc:
        raise ApiError(503, str(exc), "engine_dead") from None
    reply = await asyncio.wait_for(asyncio.wrap_future(fut), ACTION_TIMEOUT_S)
    if reply[0] == "ok":
        return reply[1]
    _, status, message, code = reply
    raise ApiError(status, message, code)


def _check_file(folder: str, name: str, must_exist: bool) -> None:
    """400 unless `name` is a plain file name in `folder` (not a symlink); 404 when it must
    exist and does not."""
    why = _bad_name(name, _name_max(folder) - _TMP_NAME_EXTRA)
    if why:
        raise ApiError(400, f"Invalid filename: {why}", "invalid_filename", "filename")
    path = os.path.join(folder, name)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if must_exist:
            raise ApiError(404, f"no slot file {name!r} in --slot-save-path", "not_found",
                           "filename") from None
        return
    if stat.S_ISLNK(st.st_mode):
        raise ApiError(400, f"Invalid filename: {name!r} is a symlink", "invalid_filename",
                       "filename")
    if not stat.S_ISREG(st.st_mode):
        raise ApiError(400, f"Invalid filename: {name!r} is not a regular file",
                       "invalid_filename", "filename")


def _name_max(folder: str) -> int:
    """The longest file name `folder`'s file system takes, in bytes."""
    return os.pathconf(folder, "PC_NAME_MAX")


def _bad_name(name: str, max_bytes: int) -> str | None:
    """Why `name` is not a plain file name of at most `max_bytes` bytes, or None."""
    if not name:
        return "empty"
    size = len(name.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        return (f"{size} bytes, longer than {max_bytes} (the folder's limit less the "
                "temporary name's extra bytes)")
    if name.startswith("."):
        return "starts with '.' (no '.', '..' or hidden names)"
    if name != name.strip():
        return "starts or ends with a space"
    bad = sorted({c for c in name if c in _RESERVED or ord(c) < 32 or ord(c) == 127
                  or 0xD800 <= ord(c) <= 0xDFFF})
    if bad:
        return f"contains {', '.join(repr(c) for c in bad)} (a path or a reserved character)"
    return None
