"""The HTTP process never loads torch: every module it runs (the command line's parser, the serve
path up to spawning the engine process, the app, its routes, context, metrics, generations,
grammar checks) imports without it; only the engine process (muser/server/engine_child.py)
does. `muser --help` and every subcommand's --help load no torch either."""

from __future__ import annotations

import json
import subprocess
import sys

SERVER_MODULES = ["muser.cli", "muser.engine_args", "muser.server.serve_args",
                  "muser.server.cli", "muser.disagg.cli", "muser.server.app",
                  "muser.server.context", "muser.server.engine_process",
                  "muser.server.metrics", "muser.server.generation",
                  "muser.server.grammar_check", "muser.server.structured",
                  "muser.server.slot_routes", "muser.server.loop_stats", "muser.constraint"]


# NOTE: what `muser serve` runs in the HTTP process before the engine process starts: the
# parser, the work main loads for it, and the flags that work reads (muser/server/cli.py)
SERVE_PATH = """
import contextlib, importlib, io
import muser.cli
parser = muser.cli.build_parser()
for command in ([], ["generate"], ["bench"], ["tune"], ["prefill-worker"], ["serve"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        parser.parse_args([*command, "--help"])
args = parser.parse_args(["serve", "--prefill-worker", "localhost:7000", "--api-key", "k"])
module, _, name = args.run.partition(":")
work = importlib.import_module(module)
assert callable(getattr(work, name))
work.disagg_options(args), work.server_options(args), work._keys(args), work.engine_kwargs(args)
"""


def _loaded_after(modules: list[str], code: str = "") -> list[str]:
    code = (f"import importlib, json, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            f"{code}\nprint(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout)


def test_the_server_process_imports_no_torch() -> None:
    loaded = _loaded_after(SERVER_MODULES)
    heavy = [m for m in loaded if m.split(".")[0] in ("torch", "triton")]
    assert not heavy, heavy[:10]
    assert "muser.engine" not in loaded and "muser.server.loop" not in loaded


def test_the_command_line_imports_no_torch_up_to_the_engine_process() -> None:
    loaded = _loaded_after([], SERVE_PATH)
    assert "muser.server.cli" in loaded and "muser.disagg.cli" in loaded
    heavy = [m for m in loaded if m.split(".")[0] in ("torch", "triton")]
    assert not heavy, heavy[:10]
    assert "muser.llm" not in loaded and "muser.server.engine_child" not in loaded


def test_the_engine_side_is_what_loads_it() -> None:
    loaded = _loaded_after(["muser.server.engine_child"])
    assert "torch" in loaded and "muser.engine" in loaded
