"""The llama.cpp server suite's `pytest -v` log -> per-file counts (printed) and a JSON receipt.

Usage: python scripts/llama_server_report.py pytest.log out.json
A log cut short (the run stopped early) gives a receipt with `complete: false` and the tests
that never ran counted as `not_run`.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import sys
from collections import Counter
from pathlib import Path

_WRAPPER = runpy.run_path(str(Path(__file__).with_name("llama_server_wrapper.py")))
EXCLUDED, FILES, is_excluded, START_TIMEOUT_S = (
    _WRAPPER[k] for k in ("EXCLUDED", "FILES", "is_excluded", "START_TIMEOUT_S"))
# NOTE: `pytest -v` lines, and pytest-xdist's ("[gw0] [  5%] PASSED unit/...")
_LINE = re.compile(r"^unit/(test_\w+\.py)::(.*?) (PASSED|FAILED|ERROR|SKIPPED)\s+\[\s*\d+%\]$")
_XDIST = re.compile(r"^\[gw\d+\] \[\s*\d+%\] (PASSED|FAILED|ERROR|SKIPPED) unit/(test_\w+\.py)::(.*?)\s*$")
_REASON = re.compile(r"^FAILURE-REASON unit/(.*?) (setup|call|teardown): (.*)$")
_COLLECTED = re.compile(r"collected (\d+) items / (\d+) deselected")
_SELECTED = re.compile(r"^(\d+)/\d+ tests collected \(\d+ deselected\)", re.MULTILINE)  # --collect-only
_WALL = re.compile(r"^suite wall time: (\d+) s$", re.MULTILINE)


def main(log: str, out: str) -> None:
    text = Path(log).read_text(errors="replace")
    outcomes: dict[str, tuple[str, str]] = {}
    late = set()  # run, then excluded (a log older than the list)
    for line in text.splitlines():
        x, m = _XDIST.match(line), _LINE.match(line)
        found = (x[2], x[3], x[1]) if x else m.groups() if m else None
        if found and is_excluded(f"unit/{found[0]}::{found[1]}"):
            late.add(found[0] + found[1])
        elif found:
            name, test, result = found
            if outcomes.get(f"{name}::{test}", ("", ""))[1] not in ("FAILED", "ERROR"):
                outcomes[f"{name}::{test}"] = (name, result)
    reasons = {f"unit/{m[1]}": f"{m[2]}: {m[3]}" for m in map(_REASON.match, text.splitlines())
               if m}
    per_file = {name: Counter() for name in FILES}
    for name, result in outcomes.values():
        per_file[name][result.lower()] += 1
    total = sum(per_file.values(), Counter())
    ran = total["passed"] + total["failed"] + total["error"]
    collected, selected = _COLLECTED.search(text), _SELECTED.search(text)
    included = (int(selected[1]) - len(late) if selected else
                int(collected[1]) - int(collected[2]) - len(late) if collected else len(outcomes))
    receipt = {
        "suite": "llama.cpp tools/server/tests from the llama-cpp-python 0.3.36 sdist",
        "pass_fraction_of_included": round(total["passed"] / ran, 4) if ran else 0.0,
        "complete": len(outcomes) == included,
        "cpus": os.cpu_count(), "load_average_at_report": [round(x, 1) for x in os.getloadavg()],
        "wall_s": int(wall[1]) if (wall := _WALL.search(text)) else None,
        "jobs": int(os.environ.get("JOBS", "1")),
        "servers_reused": os.environ.get("LLAMA_SUITE_REUSE") == "1",
        "whole_files_per_worker": os.environ.get("LLAMA_SUITE_REUSE") == "1",
        "server_start_timeout_s": START_TIMEOUT_S,
        "totals": {**total, "included": included, "not_run": included - len(outcomes)},
        "files": {name: dict(counts) for name, counts in per_file.items()},
        "failed": {f"unit/{k}": reasons.get(f"unit/{k}", "") for k, (_, r) in
                   sorted(outcomes.items()) if r in ("FAILED", "ERROR")},
        "excluded": EXCLUDED,
    }
    for name, counts in per_file.items():
        print(f"{name:26s} passed {counts['passed']:3d}  failed "
              f"{counts['failed'] + counts['error']:3d}  skipped {counts['skipped']:3d}")
    print(f"pass_fraction_of_included {receipt['pass_fraction_of_included']} "
          f"({total['passed']}/{ran} run; {included} included, "
          f"{receipt['totals']['not_run']} not run; {len(EXCLUDED)} exclusion entries)")
    Path(out).write_text(json.dumps(receipt, indent=1) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
