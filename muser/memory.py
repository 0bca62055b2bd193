"""Memory by category: what the weights, the KV caches and the step workspace hold on the
device (MemoryReport), and how many KV pages the rest of a GPU holds (size_pages). No torch
here: the HTTP server's process reads MemoryReport; the startup measures the device
(muser/startup/memory.py).

    weights ....... bytes of the prepared weights (packed CPU matrices included)
    kv_sliding .... the ring of every sliding layer, per sequence slot
    kv_pages ...... the page pool of the full-attention layers
    workspace ..... GPU: peak allocated during the warm-up beyond weights and KV (activations),
                    plus the CUDA graph pool; CPU: an estimate of the widest step's activations
    prefix_cache .. the store of ring checkpoints (--prefix-cache-gb, as many whole ones as
                    fit); cached prefix pages stay in kv_pages
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from muser.config import ModelConfig
from muser.errors import MuserError

CATEGORIES = ("weights", "kv_sliding", "kv_pages", "workspace", "prefix_cache")


@dataclass(frozen=True)
class MemoryReport:
    weights: int
    kv_sliding: int
    kv_pages: int
    workspace: int
    workspace_basis: Literal["measured", "estimated"]
    num_pages: int
    page_size: int  # rows per page
    prefix_cache: int = 0

    def categories(self) -> dict[str, int]:
        """Bytes per category, in CATEGORIES order."""
        return {name: getattr(self, name) for name in CATEGORIES}

    @property
    def total(self) -> int:
        return sum(self.categories().values())

    def pretty(self) -> str:
        """One line for the startup log."""
        return (f"memory: weights {format_bytes(self.weights)}, kv sliding "
                f"{format_bytes(self.kv_sliding)}, kv pages {format_bytes(self.kv_pages)} "
                f"({self.num_pages} x {self.page_size} rows), workspace "
                f"{format_bytes(self.workspace)} ({self.workspace_basis}), prefix cache "
                f"{format_bytes(self.prefix_cache)}; total {format_bytes(self.total)}")


def format_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def size_pages(free: int, total: int, utilization: float, workspace: int, page_bytes: int,
               min_pages: int, max_pages: int) -> int:
    """Pages of `page_bytes` that fit in utilization x total once what is in use now
    (total - free: context, weights, rings, other processes) and the step workspace are set
    aside -> at most max_pages (all sequences at full length); raises MuserError when fewer
    than min_pages (one sequence at full length) fit."""
    in_use = total - free
    budget = int(utilization * total) - in_use - workspace
    fits = max(budget, 0) // page_bytes if page_bytes else max_pages
    if fits < min_pages:
        need = min_pages * page_bytes
        raise MuserError(
            f"not enough GPU memory for the KV cache: one sequence of the full context needs "
            f"{min_pages} pages ({format_bytes(need)}), but {utilization:.2f} x "
            f"{format_bytes(total)} less {format_bytes(in_use)} in use and "
            f"{format_bytes(workspace)} of workspace leaves {format_bytes(budget)}: "
            f"{format_bytes(need - budget)} missing; raise --gpu-memory-utilization, or lower "
            f"--max-model-len")
    return min(fits, max_pages)


def estimate_workspace(cfg: ModelConfig, rows: int, context: int, logit_rows: int) -> int:
    """float32 bytes live at once in the widest step of `rows` rows: the residual and normed
    rows, QKV, the attention output, gate+up and its GeGLU, RoPE tables of both kinds, the
    K/V rows a full layer gathers for a `context`-token sequence, and `logit_rows` logits."""
    per_row = (2 * cfg.hidden_size + 2 * cfg.q_size + 2 * cfg.kv_size
               + 3 * cfg.intermediate_size + 4 * cfg.head_dim)
    return 4 * (rows * per_row + 2 * context * cfg.kv_size + logit_rows * cfg.vocab_size)
