"""The HTTP process never loads torch: every module it runs (the serve path up to spawning the
engine process, the app, its routes, context, metrics, generations, grammar checks) imports
without it; only the engine process (muser/server/engine_child.py) does."""

from __future__ import annotations

import json
import subprocess
import sys

SERVER_MODULES = ["muser.server.cli", "muser.disagg.cli", "muser.server.app",
                  "muser.server.context", "muser.server.engine_process",
                  "muser.server.metrics", "muser.server.generation",
                  "muser.server.grammar_check", "muser.server.structured",
                  "muser.server.slot_routes", "muser.server.loop_stats", "muser.constraint"]


def _loaded_after(modules: list[str]) -> list[str]:
    code = (f"import importlib, json, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout)


def test_the_server_process_imports_no_torch() -> None:
    loaded = _loaded_after(SERVER_MODULES)
    heavy = [m for m in loaded if m.split(".")[0] in ("torch", "triton")]
    assert not heavy, heavy[:10]
    assert "muser.engine" not in loaded and "muser.server.loop" not in loaded


def test_the_engine_side_is_what_loads_it() -> None:
    loaded = _loaded_after(["muser.server.engine_child"])
    assert "torch" in loaded and "muser.engine" in loaded
