"""muser: an inference engine for hybrid-attention LLMs."""

from muser.core import SamplingParams
from muser.llm import LLM, Completion

__all__ = ["LLM", "Completion", "SamplingParams"]
