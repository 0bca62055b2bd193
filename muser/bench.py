"""`muser bench`: CPU/GPU prefill and decode throughput, with llama.cpp side by side."""

from __future__ import annotations

import argparse


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure prefill and decode tokens/s")
    p.set_defaults(run=lambda args: 0)
