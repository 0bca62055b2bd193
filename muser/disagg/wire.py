"""Link: one serving node and one prefill worker over torch.distributed point to point.

Connection setup, framing and liveness are muser's; moving tensors is torch.distributed's:

    rendezvous  the worker hosts a TCPStore on --listen; the serving node connects to it and
                bumps the store's "epoch" counter; both then build a two-rank process group
                (gloo or NCCL) under that epoch's key prefix (rank 0: serving node, rank 1:
                worker). A broken link is rebuilt under the next epoch.
    framing     every message is a header (int64 length, then UTF-8 JSON bytes) and the
                tensors the header describes (shapes, dtype), sent in order on one tag.
    liveness    the worker writes a heartbeat (a counter) to its store every HEARTBEAT_S; a
                serving node that sees it unchanged for DEAD_S calls the worker down.

gloo moves CPU tensors (a GPU worker stages through pinned host memory); NCCL moves CUDA
tensors between two GPUs and needs two visible devices.
"""

from __future__ import annotations

import datetime
import json
import socket
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from muser.errors import MuserError

HEARTBEAT_S, DEAD_S = 1.0, 10.0
BACKENDS = ("gloo", "nccl")


class LinkError(MuserError):
    """The peer is unreachable, went away mid-message, or answered late."""


def check_backend(backend: str, device: torch.device) -> None:
    """Refuse what the backend cannot move, with the reason."""
    if backend not in BACKENDS:
        raise MuserError(f"unknown transport backend {backend!r} (choose from {BACKENDS})")
    if backend == "nccl":
        if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
            raise MuserError("the NCCL transport moves KV between two GPUs; "
                             f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}"
                             " visible (use --backend gloo)")
        if device.type != "cuda":
            raise MuserError("the NCCL transport needs --device cuda on both sides")


def reachable(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether something listens at host:port (tried before the store, whose failed connects
    retry for their whole timeout)."""
    try:
        with socket.create_connection((host, port), timeout_s):
            return True
    except OSError:
        return False


class Link:
    def __init__(self, store: dist.Store, epoch: int, rank: int, backend: str,
                 timeout_s: float, device: torch.device) -> None:
        self.store, self.epoch, self.rank, self.backend = store, epoch, rank, backend
        self.device = device if backend == "nccl" else torch.device("cpu")
        opts = datetime.timedelta(seconds=timeout_s)
        prefixed = dist.PrefixStore(f"epoch{epoch}", store)
        if backend == "nccl":
            self.group = dist.ProcessGroupNCCL(prefixed, rank, 2, _nccl_options(opts))
        else:
            self.group = dist.ProcessGroupGloo(prefixed, rank, 2, opts)
        self.peer = 1 - rank

    @classmethod
    def connect(cls, host: str, port: int, backend: str, timeout_s: float,
                device: torch.device) -> Link:
        """The serving node's side: a new epoch with the worker at host:port."""
        if not reachable(host, port):
            raise LinkError(f"no prefill worker listens at {host}:{port}")
        try:
            store = dist.TCPStore(host, port, is_master=False,
                                  timeout=datetime.timedelta(seconds=timeout_s))
            epoch = store.add("epoch", 1)
            return cls(store, epoch, 0, backend, timeout_s, device)
        except (RuntimeError, dist.DistError) as exc:
            raise LinkError(f"cannot connect to the prefill worker at {host}:{port}: "
                            f"{_first_line(exc)}") from None

    def announce(self) -> None:
        """Tell the worker a request follows (it posts its receive only then)."""
        try:
            self.store.add(f"epoch{self.epoch}/requests", 1)
        except (RuntimeError, dist.DistError) as exc:
            raise LinkError(f"the worker's store is gone: {_first_line(exc)}") from None

    def send(self, header: dict[str, Any], tensors: list[torch.Tensor] = ()) -> int:
        """Send a header and its tensors -> bytes sent."""
        raw = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
        parts = [torch.tensor([raw.numel()], dtype=torch.int64), raw]
        parts += [t.contiguous() for t in tensors]
        try:
            for part in parts:
                self.group.send([part.to(self.device)], self.peer, 0).wait()
        except (RuntimeError, dist.DistError) as exc:
            raise LinkError(f"send failed: {_first_line(exc)}") from None
        return sum(p.numel() * p.element_size() for p in parts)

    def recv_header(self, timeout_s: float | None = None) -> dict[str, Any]:
        size = self._recv(torch.empty(1, dtype=torch.int64), timeout_s)
        raw = self._recv(torch.empty(int(size.item()), dtype=torch.uint8), timeout_s)
        return json.loads(bytes(raw.cpu().numpy()).decode())

    def recv_tensors(self, specs: list[tuple[list[int], str]],
                     timeout_s: float | None = None) -> list[torch.Tensor]:
        """Receive tensors of the given (shape, dtype name) into fresh buffers on the link's
        device (NCCL: the GPU's, written by the transfer itself; no host buffer on the way)."""
        return [self._recv(torch.empty(shape, dtype=getattr(torch, dtype), device=self.device),
                           timeout_s) for shape, dtype in specs]

    def _recv(self, buf: torch.Tensor, timeout_s: float | None) -> torch.Tensor:
        buf = buf.to(self.device)  # NOTE: a no-op for recv_tensors' buffers (made there)
        try:
            work = self.group.recv([buf], self.peer, 0)
            if timeout_s is None:
                work.wait()
            elif not work.wait(datetime.timedelta(seconds=timeout_s)):
                raise LinkError(f"no answer within {timeout_s:.1f} s")
        except (RuntimeError, dist.DistError) as exc:
            raise LinkError(_first_line(exc)) from None
        return buf

    def heartbeat(self) -> int:
        """The worker's heartbeat counter (raises LinkError when its store is gone)."""
        try:
            return int(self.store.add("heartbeat", 0))
        except (RuntimeError, dist.DistError) as exc:
            raise LinkError(f"the worker's store is gone: {_first_line(exc)}") from None


class Listener:
    """The worker's side: its store on --listen, a heartbeat thread, and the link of the
    newest epoch a serving node opened."""

    def __init__(self, host: str, port: int, backend: str, timeout_s: float,
                 device: torch.device) -> None:
        self.backend, self.timeout_s, self.device = backend, timeout_s, device
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        self.store.add("epoch", 0)
        self._beat = threading.Thread(target=self._heartbeat, name="muser-heartbeat",
                                      daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        while True:
            self.store.add("heartbeat", 1)
            time.sleep(HEARTBEAT_S)

    def epoch(self) -> int:
        return int(self.store.add("epoch", 0))

    def requests(self, epoch: int) -> int:
        """Requests the serving node has announced on epoch `epoch`'s link."""
        return int(self.store.add(f"epoch{epoch}/requests", 0))

    def accept(self, after: int, poll_s: float = 0.1) -> Link:
        """Wait for a serving node to open an epoch newer than `after` -> its link."""
        while (epoch := self.epoch()) <= after:
            time.sleep(poll_s)
        return Link(self.store, epoch, 1, self.backend, self.timeout_s, self.device)


def _nccl_options(timeout: datetime.timedelta):
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return opts


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
