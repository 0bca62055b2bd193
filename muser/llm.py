"""LLM: the public Python API. Load once, then stream or generate."""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from muser.config import EngineConfig, default_dtypes
from muser.core import SamplingParams, StepOutput
from muser.engine import Engine
from muser.errors import ConfigError, GenerationError
from muser.graph.weights import with_fp8_head
from muser.loading import load_model
from muser.loading.default_model import model_path
from muser.loading.dummy import load_dummy
from muser.loading.fingerprint import fingerprint as model_fingerprint
from muser.ops import backend, cpu, ref
from muser.ops.fp8 import require_fp8_device
from muser.runner import Runner
from muser.scheduler import Scheduler
from muser.sequence import Sequence
from muser.startup import StartupLog
from muser.startup.draft import start_draft
from muser.startup.start import note_speculation, start


@dataclass(frozen=True, slots=True)
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    ttft_s: float
    tpot_s: float | None  # None with fewer than two new tokens
    prefill_tokens_per_s: float
    decode_tokens_per_s: float | None
    draft_tokens: int = 0  # speculative decoding's draft tokens verified
    accepted_tokens: int = 0  # of those, accepted (outputs that came from a draft)

    @classmethod
    def of(cls, req: Sequence, text: str) -> Completion:
        ttft = req.first_token_s - req.arrival_s
        steps = len(req.output_ids) - 1
        tpot = (req.finish_s - req.first_token_s) / steps if steps > 0 else None
        return cls(req.prompt_ids, req.output_ids, text, req.finish_reason, ttft, tpot,
                   req.num_prompt / ttft, 1 / tpot if tpot else None, req.num_drafted,
                   req.num_accepted)


def _stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _keeps_codes(config: EngineConfig) -> bool:
    """Whether the loader keeps the file's block codes: the CPU backend at float32 reads them
    directly (muser.ops.packed); 16-bit CPU weights and the GPU take dequantized values."""
    return backend(config.device) is cpu and config.dtype == "float32"


def _keeps_blocks(config: EngineConfig) -> bool:
    """Whether the loader keeps GGUF matrices as the file's blocks: the Triton backend reads
    Q5_0 / Q8_0 / Q4_K / Q6_K in place (muser/ops/triton/block_weights.py) unless
    gguf_weights="dequantize" asks for dense values."""
    return config.gguf_weights == "blocks" and backend(config.device) not in (cpu, ref)


def _kv_dtype_named_once(kwargs: dict) -> dict:
    """kv_cache_dtype folded into kv_dtype (one setting, two names); "auto" or None: dropped,
    so the device's default applies."""
    kwargs = dict(kwargs)
    if "kv_cache_dtype" in kwargs:
        other = kwargs.pop("kv_cache_dtype")
        if kwargs.get("kv_dtype") not in (None, other):
            raise ConfigError(f"kv_dtype={kwargs['kv_dtype']!r} and kv_cache_dtype={other!r} "
                              "name one setting twice")
        kwargs["kv_dtype"] = other
    if kwargs.get("kv_dtype") in (None, "auto"):
        kwargs.pop("kv_dtype", None)
    return kwargs


class LLM:
    def __init__(self, model: str | Path | None = None, progress: bool = True,
                 load_format: str = "auto", model_config: str | None = None,
                 log: StartupLog | None = None, dummy_made_on: str | None = None,
                 **engine_kwargs) -> None:
        """model: a GGUF file or a Hugging Face checkpoint directory (None: the embedded Gemma 3
        270M); engine_kwargs: EngineConfig (kv_cache_dtype: kv_dtype's other name, "auto"
        the device's default, as --kv-cache-dtype).
        load_format="dummy": random weights of the named `model_config` (muser/presets.py),
        drawn on `dummy_made_on` (default: the engine's device).
        Startup phases are reported to `log` (default: a line each on stderr with `progress`);
        on a GPU the engine is warmed up before this returns (`muser/startup/`)."""
        self.startup = log or StartupLog(_stderr_line if progress else None)
        engine_kwargs.setdefault("device", default_device())
        engine_kwargs = _kv_dtype_named_once(engine_kwargs)
        dtype, kv_dtype = default_dtypes(torch.device(engine_kwargs["device"]).type)
        engine_kwargs.setdefault("dtype", dtype)
        engine_kwargs.setdefault("kv_dtype", kv_dtype)
        try:
            config = EngineConfig.for_device(**engine_kwargs)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
        dtype = getattr(torch, config.dtype)
        fp8 = config.quantization == "fp8"
        if fp8:
            require_fp8_device(config.device)
        with self.startup.phase("weights"):
            if load_format == "dummy":
                loaded = load_dummy(model_config or "gemma3-1b", dtype, config.device, progress,
                                    made_on=dummy_made_on, fp8=fp8)
            else:
                loaded = load_model(model, dtype, config.device, progress, _keeps_codes(config),
                                    fp8=fp8, blocks=_keeps_blocks(config))
            weights = with_fp8_head(loaded.weights) if config.fp8_head else loaded.weights
        limit = loaded.config.max_position_embeddings
        config = dataclasses.replace(config, max_model_len=min(config.max_model_len, limit))
        self.model_config, self.tokenizer, self.path = loaded.config, loaded.tokenizer, loaded.path
        self.runner = start(self.model_config, config, weights, self.startup)
        self.draft = self._start_draft(config, dtype, progress)
        note_speculation(self.startup, self.runner, self.draft)
        # NOTE: serving's configuration: the runner's, with the chunk cap the startup measured
        self.config = c = dataclasses.replace(
            config, decode_waiting_chunk=self.runner.startup.waiting_chunk)
        scheduler = Scheduler(c.max_num_seqs, c.prefill_chunk, c.decode_waiting_chunk,
                              max_batched_tokens=c.max_batched_tokens, page_size=c.page_size)
        self.engine = Engine(self.runner, self.tokenizer, scheduler, self.draft)
        # NOTE: what startup made (the model's objects, the tokenizer's tables) lives as long as
        # the engine: frozen, the collector's full passes between tokens no longer walk it
        gc.freeze()
        self.startup.ready()

    def _start_draft(self, config: EngineConfig, dtype: torch.dtype,
                     progress: bool) -> Runner | None:
        """With --speculative draft: the draft model's runner (muser/startup/draft.py)."""
        if config.speculative != "draft":
            return None
        with self.startup.phase("draft weights"):
            loaded = load_model(model_path(config.speculative_model, progress), dtype,
                                config.device, progress, _keeps_codes(config),
                                blocks=_keeps_blocks(config))
        return start_draft(self.runner, self.tokenizer, loaded, self.startup)

    def fingerprint(self) -> str:
        """What another process compares before it uses this one's KV (a prefill worker's, a
        slot file's): muser/loading/fingerprint.py, with FP8 quantization as the weights' form."""
        c = self.config
        form = "" if c.quantization == "none" else "fp8+head" if c.fp8_head else "fp8"
        return model_fingerprint(self.model_config, self.path, form)

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Text -> ids with BOS and special tokens parsed (as llama.cpp does); ids pass through
        (TypeError for a list of anything but ints: one prompt per call)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(type(i) is int for i in prompt):
            return list(prompt)
        raise TypeError(f"prompt: a str or a list of token ids (ints), one prompt per call; "
                        f"got {type(prompt).__name__}"
                        + (f" of {type(prompt[0]).__name__}" if isinstance(prompt, list) else ""))

    def stream(self, prompt: str | list[int], sampling: SamplingParams) -> Iterator[StepOutput]:
        """Yield StepOutputs as tokens are produced (with n samples, each output's `index`
        says whose)."""
        return self.engine.run(self.engine.add_request(self.encode(prompt), sampling))

    def embed(self, prompt: str | list[int], pooling: str = "mean") -> list[list[float]]:
        """The prompt's final hidden states (after the final norm, as the LM head reads them),
        pooled (muser.core.POOLINGS: mean, last, cls, none) -> one vector [hidden_size], or one
        per prompt token with "none"; not normalized. Prefilled as a prompt, nothing sampled."""
        req = self.engine.add_request(self.encode(prompt),
                                      SamplingParams(max_tokens=0, embed=pooling))
        outs = list(self.engine.run(req))
        return [array("f", v).tolist() for v in outs[-1].embedding]

    def generate(self, prompt: str | list[int], sampling: SamplingParams) -> Completion:
        """One completion; raises GenerationError when the engine ends the request early (its
        StepOutput.error, which `stream` passes on as it is)."""
        if sampling.n != 1:
            raise ValueError("generate returns one completion: use stream for n samples")
        req = self.engine.add_request(self.encode(prompt), sampling)
        outs = list(self.engine.run(req))
        failed = next((out.error for out in outs if out.error), None)
        if failed is not None:
            raise GenerationError(failed)
        return Completion.of(req, "".join(out.text_delta for out in outs))
