"""The attention routes a chunk may take (chosen by muser/attention/routes.py); the attention
ops take the chosen one and run it."""

from __future__ import annotations

from enum import Enum


class Route(Enum):
    DECODE = "decode"
    SHORT_CHUNK = "short_chunk"
    TILED = "tiled"
    DENSE = "dense"
    STAGING = "staging"
    FALLBACK_F32 = "fallback_f32"
