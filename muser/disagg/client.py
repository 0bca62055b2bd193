"""RemotePrefill: the serving node's prefill workers, off the engine loop.

The engine hands a prompt of at least `min_tokens` tokens to `start`; a thread per worker sends
it, receives the snapshot into fresh tensors (a staging generation outside the live cache) and
verifies it before the engine sees it:

    the worker's model fingerprint (config + weight checksums) equals ours
    shapes, dtype and ring capacity are what our cache holds for that many tokens
    every layer's checksum (and the logits') matches the header's (snapshot.layer_checksums:
    computed where the tensors are, so a GPU's KV is checked on the GPU)

Every request ends with one outcome, counted and, unless "remote", logged at warning level
with its reason: remote | fallback_down (no worker, or it went away mid-transfer) |
fallback_timeout (no whole answer within `timeout_s`) | fallback_checksum | fallback_fingerprint.
A fallback means the engine prefills the prompt itself; a link that broke is rebuilt on the
next request. `done()` hands the finished ones to the engine loop, which installs or falls
back in one step; `on_done` wakes that loop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from muser.disagg.address import parse_address
from muser.disagg.wire import DEAD_S, HEARTBEAT_S, Link, LinkError, check_backend
from muser.disagg.worker import prefill
from muser.kvcache.ring import RingState
from muser.kvcache.snapshot import KVSnapshot, install
from muser.sequence import Sequence

log = logging.getLogger("muser.disagg")

OUTCOMES = ("remote", "local_short", "fallback_down", "fallback_timeout", "fallback_checksum",
            "fallback_fingerprint")
BYTE_BUCKETS = tuple(float(1 << b) for b in range(16, 36, 2))
UNMEASURED_TOKENS = 2048  # --disagg-min-tokens auto when the crossover cannot be measured
SECOND_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class Result:
    uid: int
    outcome: str
    snapshot: KVSnapshot | None = None
    reason: str = ""
    nbytes: int = 0
    seconds: float = 0.0  # the round trip: send, the worker's prefill, the KV back, checks
    receive_s: float = 0.0  # the KV's hand-off: its tensors received, after their header

    @property
    def failed(self) -> bool:
        """No snapshot came (a fallback outcome): the engine prefills the prompt itself."""
        return self.snapshot is None

    def install(self, runner, seq: Sequence) -> torch.Tensor:
        """The engine's Arrival (muser/engine/source.py): the verified snapshot installed into
        unplaced `seq` (whose prompt it prefilled) -> its last row's logits [vocab]."""
        install(runner, self.snapshot, seq.prompt_ids, seq)
        return self.snapshot.logits


class Histogram:
    """Cumulative buckets, sum and count (rendered by the server's metrics collector)."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets, self.counts = buckets, [0] * (len(buckets) + 1)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[next((i for i, b in enumerate(self.buckets) if value <= b),
                         len(self.buckets))] += 1
        self.sum += value
        self.count += 1

    def snapshot(self) -> dict:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.sum,
                "count": self.count}


@dataclass(frozen=True)
class Expect:
    """What a snapshot for this serving node must look like."""

    fingerprint: str
    num_sliding: int
    num_full: int
    row: tuple[int, int]  # kv heads, the pool's row width (head dim; FP8: packed bytes)
    window: int  # the model's sliding window: a ring of any capacity from it up installs
    vocab_size: int


class RemotePrefill:
    def __init__(self, workers: list[str], min_tokens: int, timeout_s: float, expect: Expect,
                 backend: str = "gloo", device: torch.device | None = None,
                 on_done: Callable[[], None] = lambda: None) -> None:
        if not workers:
            raise ValueError("no prefill worker given")
        self.min_tokens, self.timeout_s, self.expect = min_tokens, timeout_s, expect
        self.backend, self.on_done = backend, on_done
        self.device = device or torch.device("cpu")
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.bytes, self.seconds = Histogram(BYTE_BUCKETS), Histogram(SECOND_BUCKETS)
        self.receive_s = 0.0  # summed over remote outcomes (benchmarks: the hand-off's rate)
        self._lock = threading.Lock()
        self._done: list[Result] = []
        self._cancelled: set[int] = set()
        self._workers = [_Worker(self, parse_address(a)) for a in workers]
        self._next = 0
        self.in_flight: set[int] = set()

    def offer(self, seq: Sequence, num_uncached: int) -> bool:
        """The engine's admission source (muser/engine/source.py): a prompt of at least
        min_tokens tokens not cached there is sent to a worker (True)."""
        if num_uncached < self.min_tokens:
            return False
        self.start(seq.uid, seq.prompt_ids)
        return True

    def count_local(self) -> None:
        with self._lock:
            self.outcomes["local_short"] += 1

    def start(self, uid: int, prompt_ids: list[int]) -> None:
        """Send a prompt to the next worker (round robin); its Result comes from done()."""
        worker = self._workers[self._next % len(self._workers)]
        self._next += 1
        with self._lock:
            self.in_flight.add(uid)
        worker.jobs.put((uid, list(prompt_ids), None))

    def cancel(self, uid: int) -> None:
        """Forget a request whose prefill is remote: its result is dropped when it comes."""
        with self._lock:
            if uid in self.in_flight:
                self._cancelled.add(uid)

    @property
    def has_done(self) -> bool:
        return bool(self._done)

    def done(self) -> list[Result]:
        with self._lock:
            results, self._done = self._done, []
        return results

    def stats(self) -> dict:
        with self._lock:
            return {"outcomes": dict(self.outcomes), "bytes": self.bytes.snapshot(),
                    "seconds": self.seconds.snapshot(), "receive_s": self.receive_s,
                    "in_flight": len(self.in_flight),
                    "workers": {w.name: w.state for w in self._workers}}

    def measure(self, prompt_ids: list[int]) -> float | None:
        """Seconds of one remote round trip for `prompt_ids` on the first worker (None: it
        failed); used to find the crossover at startup (not counted as a request)."""
        reply: queue.Queue = queue.Queue()
        start = time.perf_counter()
        self._workers[0].jobs.put((-1, list(prompt_ids), reply))
        result = reply.get()
        return time.perf_counter() - start if result.outcome == "remote" else None

    def _finish(self, result: Result) -> None:
        if result.outcome != "remote":
            log.warning("request %d: remote prefill failed (%s): %s; prefilling locally",
                        result.uid, result.outcome, result.reason)
        with self._lock:
            self.outcomes[result.outcome] += 1
            if result.outcome == "remote":
                self.bytes.observe(result.nbytes)
                self.seconds.observe(result.seconds)
                self.receive_s += result.receive_s
            self.in_flight.discard(result.uid)
            if result.uid in self._cancelled:
                self._cancelled.discard(result.uid)
                return
            self._done.append(result)
        self.on_done()


class _Worker:
    """One prefill worker: its link (rebuilt after a failure) and the thread that talks to it."""

    def __init__(self, owner: RemotePrefill, address: tuple[str, int]) -> None:
        self.owner, self.address = owner, address
        self.name = f"{address[0]}:{address[1]}"
        self.link: Link | None = None
        self.state = "unknown"
        self.jobs: queue.Queue = queue.Queue()
        self._beat, self._beat_seen = -1, time.monotonic()
        threading.Thread(target=self._run, name=f"muser-prefill-{self.name}",
                         daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                uid, prompt_ids, reply = self.jobs.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                self._check_alive()
                continue
            result = self.transfer(uid, prompt_ids)
            if reply is None:
                self.owner._finish(result)
            else:
                reply.put(result)

    def _check_alive(self) -> None:
        """Between requests: a gone store or a heartbeat stale for DEAD_S marks it down."""
        if self.link is None:
            return
        try:
            beat = self.link.heartbeat()
        except LinkError as exc:
            return self._down(str(exc))
        now = time.monotonic()
        if beat != self._beat:
            self._beat, self._beat_seen = beat, now
        elif now - self._beat_seen > DEAD_S:
            self._down(f"no heartbeat for {now - self._beat_seen:.0f} s")

    def _down(self, reason: str) -> None:
        if self.state != "down":
            log.warning("prefill worker %s is down: %s", self.name, reason)
        self.state, self.link = "down", None

    def transfer(self, uid: int, prompt_ids: list[int]) -> Result:
        o = self.owner
        start = time.perf_counter()
        deadline = start + o.timeout_s
        try:
            if self.link is None:
                self.link = Link.connect(*self.address, o.backend, o.timeout_s, o.device)
                self._beat, self._beat_seen = -1, time.monotonic()
            link = self.link
            link.announce()
            link.send({"uid": uid, "fingerprint": o.expect.fingerprint,
                       "prompt_ids": prompt_ids})
            header = link.recv_header(max(0.0, deadline - time.perf_counter()))
            if header.get("status") == "fingerprint":
                self.state = "up"
                return Result(uid, "fallback_fingerprint", reason=(
                    f"the worker serves model {header.get('fingerprint')}, "
                    f"this node {o.expect.fingerprint}"))
            problem = _check_header(header, o.expect, len(prompt_ids))
            if problem:
                self._reset()
                return Result(uid, "fallback_checksum", reason=problem)
            received = time.perf_counter()
            tensors = link.recv_tensors(header["tensors"],
                                        max(0.0, deadline - time.perf_counter()))
            if tensors and tensors[0].is_cuda:  # NOTE: NCCL's wait orders the stream only
                torch.cuda.current_stream(tensors[0].device).synchronize()
            received = time.perf_counter() - received
        except LinkError as exc:
            timed_out = time.perf_counter() >= deadline or "within" in str(exc)
            self._reset()
            if not timed_out:
                self.state = "down"
            return Result(uid, "fallback_timeout" if timed_out else "fallback_down",
                          reason=str(exc))
        self.state = "up"
        sliding, full, logits = tensors
        snap = KVSnapshot(header["num_tokens"], RingState(*header["ring"]), sliding, full,
                          logits)
        if snap.checksums() != header["checksums"]:
            return Result(uid, "fallback_checksum",
                          reason="the KV received does not match its checksums")
        nbytes = snap.nbytes
        return Result(uid, "remote", snap, nbytes=nbytes,
                      seconds=time.perf_counter() - start, receive_s=received)

    def _reset(self) -> None:
        self.link = None  # NOTE: the next request opens a new epoch


def _check_header(header: dict, expect: Expect, num_tokens: int) -> str:
    """'' when the header describes a snapshot we can install, else why not."""
    if header.get("status") != "ok":
        return f"the worker answered {header.get('status')!r}"
    if header.get("fingerprint") != expect.fingerprint:
        return "the worker's fingerprint changed mid-request"
    if header.get("num_tokens") != num_tokens:
        return f"{header.get('num_tokens')} tokens prefilled for a {num_tokens}-token prompt"
    cap, _, _, length = header["ring"]
    if cap < expect.window or length != min(num_tokens, cap):
        return f"ring {header['ring']} for window {expect.window}"
    want = [[expect.num_sliding, 2, length, *expect.row], [expect.num_full, 2, num_tokens,
                                                           *expect.row], [expect.vocab_size]]
    shapes = [shape for shape, _ in header["tensors"]]
    if shapes != want:
        return f"tensor shapes {shapes}, expected {want}"
    dtypes = {dtype for _, dtype in header["tensors"][:2]}
    if len(dtypes) != 1 or not hasattr(torch, next(iter(dtypes))):
        return f"KV dtypes {sorted(dtypes)}"
    if len(header.get("checksums", ())) != expect.num_sliding + expect.num_full + 1:
        return "the checksums do not cover every layer"
    return ""


def attach(llm, workers: list[str], min_tokens: int | None, timeout_s: float,
           backend: str = "gloo") -> RemotePrefill:
    """Give `llm`'s engine these prefill workers (an admission source it takes prompts'
    prefills from); min_tokens None: the crossover measured now (remote never faster: every
    prompt stays local). -> the RemotePrefill."""
    runner, cfg, engine = llm.runner, llm.model_config, llm.engine
    check_backend(backend, runner.device)
    # NOTE: the row as our pool holds it: an FP8 cache's packed rows (muser/ops/kv_fp8.py)
    # take only a worker's FP8 rows, byte for byte
    expect = Expect(llm.fingerprint(), len(cfg.layers_of("sliding")),
                    len(cfg.layers_of("global")), tuple(runner.pool.rows(0)[0].shape[1:]),
                    cfg.sliding_window, cfg.vocab_size)
    remote = RemotePrefill(workers, min_tokens or 0, timeout_s, expect, backend,
                           runner.device, on_done=lambda: engine.wake())
    if min_tokens is None:
        remote.min_tokens = crossover(llm, remote)
    engine.add_source(remote)
    log.info("prefill workers %s: prompts of %s tokens or more go remote (fingerprint %s)",
             ", ".join(workers), remote.min_tokens if remote.min_tokens < 1 << 60 else "no",
             expect.fingerprint)
    return remote


def crossover(llm, remote: RemotePrefill, lengths: tuple[int, ...] = (128, 512, 2048, 8192)
              ) -> int:
    """The shortest of `lengths` whose remote round trip beats prefilling it here (each
    timed once after a first untimed pair) -> tokens (1 << 62: none did; UNMEASURED_TOKENS
    when no round trip succeeded, e.g. the worker is not up yet)."""
    fits = [n for n in lengths if n < llm.config.max_model_len]
    answered = False
    for i, n in enumerate(fits):
        ids = [(7 * j) % 1000 + 10 for j in range(n)]
        if i == 0:
            prefill(llm, ids), remote.measure(ids)
        start = time.perf_counter()
        prefill(llm, ids)
        local = time.perf_counter() - start
        far = remote.measure(ids)
        log.info("crossover: %d tokens: local prefill %.3f s, remote round trip %s", n, local,
                 "failed" if far is None else f"{far:.3f} s")
        answered = answered or far is not None
        if far is not None and far < local:
            return n
    if not answered:
        log.warning("crossover not measured (no remote round trip succeeded): prompts of %d "
                    "tokens or more go remote", UNMEASURED_TOKENS)
        return UNMEASURED_TOKENS
    return 1 << 62
