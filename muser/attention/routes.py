"""The attention route tree: a pure function from chunk shape and cache state to a route.

    num_rows == 1 ............................................ DECODE
    sliding layer whose ring cannot take the chunk in place .. STAGING (gather tail + chunk,
                                                               attend, then commit)
    num_rows < SHORT_CHUNK_ROWS .............................. SHORT_CHUNK (decode per row)
    chunk starts on a tile boundary .......................... TILED (tile classifier)
    anything else contiguous ................................. DENSE
    float32 fail-safe requested .............................. FALLBACK_F32

STAGING attends its detached shadow with the inner route picked by the same rules.
"""

from __future__ import annotations

from muser.config import LayerKind
from muser.kvcache.ring import RingState
from muser.ops.routes import Route

SHORT_CHUNK_ROWS = 16


def choose_route(
    kind: LayerKind,
    num_rows: int,
    start: int,
    ring: RingState | None,
    tile: int,
    force_f32: bool = False,
) -> Route:
    """Route for a chunk of `num_rows` new rows at logical position `start` of one sequence."""
    if num_rows < 1:
        raise ValueError("a chunk has at least one row")
    if force_f32:
        return Route.FALLBACK_F32
    if num_rows == 1:
        return Route.DECODE
    if kind == "sliding" and not ring.can_append_in_place(num_rows):
        return Route.STAGING
    return inner_route(num_rows, start, tile)


def inner_route(num_rows: int, start: int, tile: int) -> Route:
    """Route over a contiguous key range (the cache in place, or a staging shadow)."""
    if num_rows < SHORT_CHUNK_ROWS:
        return Route.SHORT_CHUNK
    if start % tile == 0:
        return Route.TILED
    return Route.DENSE
