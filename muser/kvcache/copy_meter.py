"""CopyMeter: bytes and seconds of the copies between the device and the host tier, per
direction ("to_host", "to_device").

On a GPU the copies are queued on the current stream (the host does not wait for them), so
their time is read from CUDA events once the stream has passed them; on the CPU a copy is done
when it returns, and its wall time is its time.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import torch

DIRECTIONS = ("to_host", "to_device")


class CopyMeter:
    def __init__(self, device: torch.device) -> None:
        self.is_cuda = device.type == "cuda"
        self.bytes = dict.fromkeys(DIRECTIONS, 0)
        self._seconds = dict.fromkeys(DIRECTIONS, 0.0)
        self._pending: deque[tuple[str, torch.cuda.Event, torch.cuda.Event]] = deque()

    @contextmanager
    def timed(self, direction: str, nbytes: int) -> Iterator[None]:
        """Count the copies made inside as `nbytes` moved in `direction`."""
        self.bytes[direction] += nbytes
        if not self.is_cuda:
            start = time.perf_counter()
            yield
            self._seconds[direction] += time.perf_counter() - start
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._pending.append((direction, start, end))

    def seconds(self) -> dict[str, float]:
        """Seconds spent copying, per direction: every copy the device has finished."""
        while self._pending and self._pending[0][2].query():
            direction, start, end = self._pending.popleft()
            self._seconds[direction] += start.elapsed_time(end) / 1e3
        return dict(self._seconds)
