"""The llama.cpp server suite's JUnit XML -> per-file counts (printed) and a JSON receipt.

Usage: python scripts/llama_server_report.py junit.xml out.json
"""

from __future__ import annotations

import json
import runpy
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

_WRAPPER = runpy.run_path(str(Path(__file__).with_name("llama_server_wrapper.py")))
EXCLUDED, FILES = _WRAPPER["EXCLUDED"], _WRAPPER["FILES"]


def outcome(case: ET.Element) -> str:
    for tag in ("failure", "error", "skipped"):
        if case.find(tag) is not None:
            return {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
    return "passed"


def main(junit: str, out: str) -> None:
    per_file = {name: Counter() for name in FILES}
    failed = []
    for case in ET.parse(junit).iter("testcase"):
        name = case.get("classname", "").split(".")[-1] + ".py"
        result = outcome(case)
        per_file.setdefault(name, Counter())[result] += 1
        if result in ("failed", "error"):
            failed.append(f"unit/{name}::{case.get('name')}")
    total = sum(per_file.values(), Counter())
    ran = total["passed"] + total["failed"] + total["error"]
    receipt = {
        "suite": "llama.cpp tools/server/tests from the llama-cpp-python 0.3.36 sdist",
        "pass_fraction_of_included": round(total["passed"] / ran, 4) if ran else 0.0,
        "totals": dict(total),
        "files": {name: dict(counts) for name, counts in per_file.items()},
        "failed": failed,
        "excluded": EXCLUDED,
    }
    for name, counts in per_file.items():
        print(f"{name:28s} passed {counts['passed']:3d}  failed {counts['failed'] + counts['error']:3d}"
              f"  skipped {counts['skipped']:3d}")
    print(f"pass_fraction_of_included {receipt['pass_fraction_of_included']}"
          f" ({total['passed']}/{ran}; {len(EXCLUDED)} exclusions)")
    Path(out).write_text(json.dumps(receipt, indent=1) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
