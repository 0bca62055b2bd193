"""A prefill worker's HOST:PORT, parsed where no transport is loaded (the HTTP process checks
`--prefill-worker` without torch)."""

from __future__ import annotations


def parse_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)
