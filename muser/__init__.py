"""muser: an inference engine for hybrid-attention LLMs.

`LLM` and `Completion` load on first use, so that importing a torch-free part of the package
(the HTTP server process, the CLI's argument parsing) does not import torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from muser.core import SamplingParams

if TYPE_CHECKING:
    from muser.llm import LLM, Completion

__all__ = ["LLM", "Completion", "SamplingParams"]


def __getattr__(name: str):
    if name in ("LLM", "Completion"):
        from muser import llm  # NOTE: torch, only when the engine is wanted

        return getattr(llm, name)
    raise AttributeError(f"module 'muser' has no attribute {name!r}")
