"""`muser prefill-worker`: prefill prompts for a serving node and send back their KV.

One request at a time: the serving node's header (request id, model fingerprint, prompt ids)
-> the prompt prefilled in chunks of --prefill-chunk rows on this worker's runner (the rules
the serving node's own prefill follows; on the CPU the result does not depend on them) -> a
header (status, shapes, dtype, ring metadata, per-layer checksums) and the KV tensors and
last-row logits (muser/kvcache/snapshot.py). A request for another model is answered with this
worker's fingerprint and nothing else.
"""

from __future__ import annotations

import logging
import time

import torch

from muser.disagg.wire import Link, LinkError, Listener
from muser.kvcache.snapshot import KVSnapshot, export

log = logging.getLogger("muser.disagg")

POLL_S = 0.002


def prefill(llm, prompt_ids: list[int]) -> KVSnapshot:
    """Prefill `prompt_ids` on a fresh sequence of `llm`'s runner -> its snapshot (the
    sequence is freed)."""
    runner = llm.runner
    seq = runner.allocate()
    try:
        return export(runner, seq, runner.prefill(seq, prompt_ids)[-1])
    finally:
        runner.free(seq)


def response(snap: KVSnapshot, uid: int, fingerprint: str) -> tuple[dict, list[torch.Tensor]]:
    """The header and tensors that carry `snap`, staged in pinned host memory when it is on
    a GPU (gloo moves host tensors)."""
    tensors = [_host(t) for t in (snap.sliding, snap.full, snap.logits)]
    ring = snap.ring
    header = {"status": "ok", "uid": uid, "fingerprint": fingerprint,
              "num_tokens": snap.num_tokens,
              "ring": [ring.capacity, ring.logical_origin, ring.physical_origin, ring.length],
              "tensors": [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in tensors],
              "checksums": snap.checksums()}
    return header, tensors


def _host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        return t
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)


def serve_one(llm, link: Link, fingerprint: str, timeout_s: float) -> None:
    request = link.recv_header(timeout_s)
    uid = request.get("uid")
    if request.get("fingerprint") != fingerprint:
        log.warning("request %s is for model %s; this worker serves %s", uid,
                    request.get("fingerprint"), fingerprint)
        link.send({"status": "fingerprint", "uid": uid, "fingerprint": fingerprint})
        return
    start = time.perf_counter()
    snap = prefill(llm, request["prompt_ids"])
    header, tensors = response(snap, uid, fingerprint)
    sent = link.send(header, tensors)
    log.info("request %s: %d tokens prefilled and sent (%d bytes) in %.3f s", uid,
             snap.num_tokens, sent, time.perf_counter() - start)


def run(llm, listener: Listener, fingerprint: str) -> None:
    """Serve forever: each request the serving node announces on the newest epoch's link."""
    link, epoch, handled = None, 0, 0
    while True:
        if listener.epoch() > epoch:  # a serving node (re)connected
            link = listener.accept(epoch)
            epoch, handled = link.epoch, 0
            log.info("serving node connected (epoch %d)", epoch)
        if link is None or listener.requests(epoch) <= handled:
            time.sleep(POLL_S)
            continue
        handled += 1
        try:
            serve_one(llm, link, fingerprint, listener.timeout_s)
        except LinkError as exc:
            log.warning("link to the serving node broken (%s); waiting for it to reconnect",
                        exc)
            link = None
