"""Measured kernel picks kept across processes, one JSON file per machine fingerprint:

    <cache dir>/tuning/<gpu>-<hash of the fingerprint>.json
    {"fingerprint": {"gpu": ..., "driver": ..., "cuda": ..., "torch": ..., "triton": ...},
     "picks": {"<shape key>": <entry>, ...}}

The warm-up's kernel list (`muser/ops/triton/kernel_list.py`) is kept the same way under
<cache dir>/kernels. A file is trusted only whole and only for its own fingerprint: one that
does not parse, or whose fingerprint is not this process's (copied from another machine, or
written by other versions), is ignored with a warning and overwritten on the next save. What an
entry means is the caller's business (`muser/ops/triton/picks.py`, `kernel_list.py`); saving
merges with what is on disk and replaces the file atomically, so two processes tuning at once
lose nothing but a race.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any


class TuningCache:
    def __init__(self, path: Path, fingerprint: dict[str, str]) -> None:
        self.path, self.fingerprint = path, fingerprint

    @classmethod
    def at(cls, root: Path, fingerprint: dict[str, str], folder: str = "tuning") -> TuningCache:
        """The cache file of `fingerprint` under `root`/`folder`."""
        digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()
        gpu = re.sub(r"[^A-Za-z0-9]+", "-", fingerprint.get("gpu", "device")).strip("-").lower()
        return cls(root / folder / f"{gpu}-{digest[:12]}.json", fingerprint)

    def load(self) -> dict[str, Any]:
        """Entries stored for this fingerprint; {} when the file is absent, corrupt or foreign."""
        return read_picks(self.path, self.fingerprint)

    def save(self, picks: dict[str, Any]) -> None:
        """Store `picks` over what the file already holds."""
        merged = {**self.load(), **picks}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tuning-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump({"fingerprint": self.fingerprint, "picks": merged}, f, indent=1,
                      sort_keys=True)
        os.replace(tmp, self.path)


def read_picks(path: Path, fingerprint: dict[str, str] | None) -> dict[str, Any]:
    """The picks of a tuning file written for `fingerprint` (None: any fingerprint); {} with a
    warning when the file is corrupt or foreign, {} silently when it does not exist."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeError, ValueError) as exc:
        warnings.warn(f"ignoring the tuning cache {path}: unreadable ({exc})", stacklevel=3)
        return {}
    if not (isinstance(data, dict) and isinstance(data.get("picks"), dict)
            and isinstance(data.get("fingerprint"), dict)):
        warnings.warn(f"ignoring the tuning cache {path}: not a tuning file", stacklevel=3)
        return {}
    if fingerprint is not None and data["fingerprint"] != fingerprint:
        warnings.warn(f"ignoring the tuning cache {path}: written for {data['fingerprint']}, "
                      f"this is {fingerprint}", stacklevel=3)
        return {}
    return data["picks"]


def read_fingerprint(path: Path) -> dict[str, str]:
    """The fingerprint a tuning file was written for ({} if it cannot be read)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeError, ValueError):
        return {}
    return data.get("fingerprint", {}) if isinstance(data, dict) else {}
