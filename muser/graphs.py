"""CUDA graphs of the decode width: one graph per batch-size bucket, one shared memory pool.

Static inputs live in GraphBuffers: one int32 device buffer (token ids, positions and every
kind's decode metadata; layout in attention/decode_meta.py), uploaded from its pinned host twin
by the graph itself at the start of each replay, and the captured logits. Padding rows of a
bucket store nothing (write_dst = -1) and attend nothing (lens = 0). Prefill stays eager.

A row whose token id is packed as -1 takes it from `feed`, a device buffer: a step launched
before the host knows its tokens (the engine's decode ahead) is fed the ones just sampled on the
device. The host buffer may be packed again once the graph has uploaded it (an event recorded
inside the graph after the upload), not only once the whole step has run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from muser.attention.decode_meta import AheadPacker, DecodeLayout
from muser.attention.plan import SeqInput, StepPlan
from muser.config import ModelConfig
from muser.graph.decoder import Decoder
from muser.kvcache.ring import RingState


def graph_batch_sizes(max_bs: int) -> list[int]:
    """[1, 2, 4, 8] + range(16, max_bs + 1, 16), capped at max_bs, largest first."""
    sizes = [s for s in [1, 2, 4, 8] if s <= max_bs] + list(range(16, max_bs + 1, 16))
    if max_bs not in sizes:
        sizes.append(max_bs)
    return sorted(set(sizes), reverse=True)


@dataclass(slots=True)
class GraphBuffers:
    layout: DecodeLayout
    meta: torch.Tensor  # int32 [layout.size] on the device: what the graphs read
    host: torch.Tensor  # pinned twin, packed on the host each step
    feed: torch.Tensor  # int32 [max_bs]: the ids of rows packed as -1
    logits: dict[int, torch.Tensor]  # bucket -> captured output [bs, vocab]


class DecodeGraphs:
    def __init__(self, cfg: ModelConfig, model: Decoder, max_bs: int, ring_capacity: int,
                 page_size: int, max_pages: int, device: torch.device) -> None:
        self.cfg, self.model, self.max_bs = cfg, model, max_bs
        layout = DecodeLayout(max_bs, ring_capacity, page_size, max_pages)
        self.buf = GraphBuffers(
            layout, torch.zeros(layout.size, dtype=torch.int32, device=device),
            torch.zeros(layout.size, dtype=torch.int32).pin_memory(),
            torch.zeros(max_bs, dtype=torch.int32, device=device), {},
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_s = 0.0
        self._uploaded = torch.cuda.Event(external=True)  # NOTE: recorded by each replay
        self.packer = AheadPacker(layout)

    def _forward(self, bs: int) -> torch.Tensor:
        layout, meta = self.buf.layout, self.buf.meta
        plan = StepPlan({"sliding": [], "global": []}, [], self.cfg.sliding_window, 64, {},
                        decode=layout.metas(meta, bs))
        return self.model.forward(layout.view(meta, "input_ids", bs),
                                  layout.view(meta, "positions", bs), plan, None,
                                  self.buf.feed[:bs])

    @property
    def is_captured(self) -> bool:
        return bool(self.graphs)

    @torch.inference_mode()
    def forward_padded(self, bs: int) -> torch.Tensor:
        """One eager decode step of bucket `bs` over padding rows only (warm-up)."""
        self._pack([], [])
        self.buf.meta.copy_(self.buf.host)
        return self._forward(bs)

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every bucket, largest first, into one pool, and launch each once (over
        padding rows) -> seconds taken."""
        start = time.perf_counter()
        pool = None
        for bs in graph_batch_sizes(self.max_bs):
            self.forward_padded(bs)  # NOTE: kernels are chosen and loaded outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                # NOTE: the metadata upload is a node of the graph: each replay reads the
                # pinned host buffer as packed just before it (no separate copy call per step).
                self.buf.meta.copy_(self.buf.host, non_blocking=True)
                self._uploaded.record()
                self.buf.logits[bs] = self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = graph
        for graph in self.graphs.values():
            graph.replay()  # NOTE: a graph's first launch uploads it: not on the request path
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - start
        return self.capture_s

    def _pack(self, seqs: list[SeqInput], token_ids: list[int]) -> list[RingState]:
        return self.packer.pack(self.buf.host, self.cfg, seqs, token_ids)

    def replay(self, seqs: list[SeqInput], token_ids: list[int],
               feed: torch.Tensor | None = None) -> tuple[torch.Tensor, list[RingState]]:
        """One decode step for single-row `seqs` -> (logits [len(seqs), vocab] float32, each
        sequence's ring after the step). feed: the rows' ids on the device instead (token_ids
        is then ignored)."""
        bs = min(s for s in self.graphs if s >= len(seqs))
        self._uploaded.synchronize()  # NOTE: the last replay has read the pinned buffer
        if feed is not None:
            self.buf.feed[:len(seqs)].copy_(feed)
            token_ids = [-1] * len(seqs)
        rings = self._pack(seqs, token_ids)
        self.graphs[bs].replay()
        logits = self.buf.logits[bs][:len(seqs)].clone()
        self.packer.pack_ahead(self.cfg, seqs, rings)  # NOTE: while the GPU runs this step
        return logits, rings
