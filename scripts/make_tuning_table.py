"""Regenerate the projection picks shipped for the H200 (`muser/ops/triton/picks_h200.json`):
`muser tune` for the presets into an empty cache, then the cache file it wrote, as is.

    MUSER_CACHE_DIR=$(mktemp -d) MUSER_SHIPPED_PICKS=none python scripts/make_tuning_table.py

Run it on the GPU the table is for (the file records that machine's fingerprint).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from muser.env import cache_dir

PRESETS = ("gemma3-1b", "gemma3-27b")
TABLE = Path(__file__).resolve().parents[1] / "muser" / "ops" / "triton" / "picks_h200.json"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=TABLE)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    args = ap.parse_args()
    tuning = cache_dir() / "tuning"
    if tuning.exists() and any(tuning.iterdir()):
        sys.exit(f"{tuning} is not empty: point MUSER_CACHE_DIR at an empty directory")
    cmd = [sys.executable, "-m", "muser", "tune", "--device", "cuda", "--max-model-len", "4096",
           "--max-num-seqs", str(args.max_num_seqs), "--prefill-chunk", str(args.prefill_chunk)]
    for name in PRESETS:
        cmd += ["--preset", name]
    subprocess.run(cmd, check=True)
    (written,) = tuning.glob("*.json")
    shutil.copy(written, args.out)
    print(f"{args.out}: {written.stat().st_size} bytes from {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
