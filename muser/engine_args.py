"""The engine's command-line flags, shared by every subcommand that loads a model (`generate`,
`bench`, `serve`, `tune`, `prefill-worker`), and the argument types they parse with."""

from __future__ import annotations

import argparse

from muser.config import NUM_SPECULATIVE_TOKENS
from muser.errors import MuserError


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative(kind: type):
    def parse(text: str):
        value = kind(text)
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
        return value
    return parse


def unit_interval(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def utilization(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every subcommand that loads a model (1:1 with EngineConfig)."""
    p.add_argument("--model", metavar="PATH", help="GGUF file, or Hugging Face checkpoint "
                   "directory (or its config.json) (default: the embedded Gemma 3 270M Q4_K_M, "
                   "assembled into ~/.cache/muser on first use)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--dtype", choices=["bfloat16", "float32", "float16"],
                   help="weight/activation dtype of the projections (default: bfloat16 on the "
                   "GPU, float32 on the CPU, where float32 keeps the file's block codes and 16-bit "
                   "weights hold dequantized values)")
    p.add_argument("--kv-cache-dtype", "--kv-dtype", dest="kv_dtype",
                   choices=["auto", "bfloat16", "float16", "float32", "fp8"],
                   help="KV cache dtype (--kv-dtype: the same flag). auto: float32 on the CPU, "
                   "where attention computes in float32 anyway (a 16-bit cache there holds and "
                   "reads half the bytes, widened exactly as the kernel reads it); bfloat16 on "
                   "the GPU. fp8 (GPU): e4m3 codes with a power-of-two scale per token row and "
                   "KV head, in the global pages and the sliding rings (~1.94x the tokens of "
                   "bfloat16), read directly by the attention kernels; refused on the CPU "
                   "(default: auto)")
    p.add_argument("--quantization", choices=["none", "fp8"], default="none",
                   help="fp8: the projections (QKV, O, gate/up, down) as FP8 e4m3 weights with "
                   "one float32 scale per output row, quantized at load, or as stored in an FP8 "
                   "Hugging Face checkpoint (compressed-tensors, fbgemm_fp8); the LM head too "
                   "unless --no-fp8-head. Needs a CUDA GPU of compute capability >= 8.9 "
                   "(Ada, Hopper); refused on the CPU. Without it an FP8 checkpoint loads "
                   "dequantized to --dtype (default: %(default)s)")
    p.add_argument("--fp8-head", action=argparse.BooleanOptionalAction,
                   help="with --quantization fp8: the LM head (Gemma's tied embedding, whose "
                   "lookup then reads the same codes) as FP8 with a scale per vocabulary row: "
                   "half the bytes a decode step reads for it; --no-fp8-head keeps it in "
                   "--dtype (default: on with --quantization fp8)")
    p.add_argument("--prefill-chunk", type=positive_int,
                   help="most rows of one prompt per step (default: 512 on the CPU, 2048 on a "
                   "GPU, where a lone prompt's chunk may fill the step's budget); the prefix "
                   "cache checkpoints where a chunk ends on a multiple of 512 tokens")
    p.add_argument("--max-model-len", type=positive_int, default=32768,
                   help="context length in tokens, capped by the model's (default: %(default)s)")
    p.add_argument("--gpu-memory-utilization", type=utilization, default=0.90, metavar="F",
                   help="share of the GPU's memory for weights, KV cache and step workspace; "
                   "the KV pages take what is left of it (default: %(default)s)")
    p.add_argument("--threads", type=positive_int, help="CPU threads (default: all cores)")
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction,
                   help="a prompt that begins with a prefix computed before starts after it; "
                   "--no-prefix-cache computes every prompt from its first token (default: on)")
    p.add_argument("--prefix-cache-gb", type=non_negative(float), metavar="GB",
                   help="memory for the sliding layers' ring checkpoints of cached prefixes "
                   "(default: 1 on the CPU, 8 on a GPU)")
    p.add_argument("--kv-host-gb", type=non_negative(float), default=0.0, metavar="GB",
                   help="a host-memory tier of the prefix cache: GB of host memory set aside at "
                   "startup (pinned with a GPU); cached prefix pages and ring checkpoints the "
                   "device evicts are copied there instead of dropped, and a later prompt that begins with "
                   "them gets them back by a copy instead of computing them again; its own LRU "
                   "drops the oldest when full (default: %(default)s, none)")
    p.add_argument("--decode-ahead", action=argparse.BooleanOptionalAction,
                   help="queue each decode step on the GPU before the last step's tokens reach "
                   "the host (fed the tokens sampled on the device), so the host's work per "
                   "token overlaps the GPU's; a sequence that stops has one row computed in "
                   "vain (default: on where decode steps replay CUDA graphs)")
    p.add_argument("--gguf-weights", choices=["blocks", "dequantize"], default="blocks",
                   help="GPU, GGUF files: blocks keeps Q5_0, Q8_0, Q4_K and Q6_K matrices as the "
                   "file's bytes (device memory about the file's size; other types are "
                   "dequantized, and a warning names them); dequantize expands every matrix to "
                   "--dtype (default: %(default)s)")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: seeded random weights of --model-config, made on the device")
    p.add_argument("--model-config", metavar="NAME", default="gemma3-1b",
                   help="shape for --load-format dummy: gemma3-270m|1b|4b|12b|27b, or "
                   "muse-glimmer (52 layers, 3 sliding : 1 NoPE full) (default: %(default)s)")


def add_decode_args(p: argparse.ArgumentParser) -> None:
    """The flags of the subcommands that decode through the engine's steps (`generate`,
    `serve`): speculative decoding, context shift."""
    p.add_argument("--context-shift", action="store_true",
                   help="when a sequence fills the context, drop the oldest half of its tokens "
                   "after the first n_keep (llama-server's) and go on: the KV of what is kept "
                   "is computed again as a prefill of it (default: the sequence ends with "
                   "finish reason length)")
    p.add_argument("--speculative", choices=["none", "ngram", "draft"], default="none",
                   help="speculative decoding: ngram drafts each sequence's next tokens by "
                   "prompt lookup (what followed the latest earlier occurrence of its last 2-4 "
                   "tokens in its prompt and outputs), draft by a small model sharing the "
                   "target's vocabulary (--speculative-model; CPU only for now); the drafts are "
                   "verified in one pass at the width of the decode row and its drafts; outputs "
                   "are exactly plain decoding's (greedy and seeded sampling), they come faster "
                   "where the drafts hold (default: %(default)s)")
    p.add_argument("--speculative-model", metavar="PATH|NAME",
                   help="with --speculative draft: the draft model, a GGUF file or Hugging Face "
                   "checkpoint directory, or gemma3-270m (the embedded Gemma 3 270M); its "
                   "tokenizer must equal the target's")
    p.add_argument("--num-speculative-tokens", type=positive_int,
                   default=NUM_SPECULATIVE_TOKENS, metavar="K",
                   help="with --speculative: most draft tokens per sequence and step; each "
                   "sequence's draft length adapts to what its drafts accept (default: "
                   "%(default)s, chosen by measurement on the CPU)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    if args.fp8_head is not None and args.quantization != "fp8":
        raise MuserError("--fp8-head / --no-fp8-head apply with --quantization fp8 only")
    kwargs = {"prefill_chunk": args.prefill_chunk, "max_model_len": args.max_model_len,
              "gpu_memory_utilization": args.gpu_memory_utilization,
              "num_threads": args.threads, "prefix_cache": args.prefix_cache,
              "prefix_cache_gb": args.prefix_cache_gb, "kv_host_gb": args.kv_host_gb,
              "quantization": args.quantization,
              "fp8_head": args.fp8_head, "gguf_weights": args.gguf_weights,
              "decode_ahead": args.decode_ahead}
    if hasattr(args, "speculative"):
        kwargs |= {"speculative": args.speculative,
                   "num_speculative_tokens": args.num_speculative_tokens,
                   "speculative_model": args.speculative_model,
                   "context_shift": args.context_shift}
    if args.device:
        kwargs["device"] = args.device
    for name in ("dtype", "kv_dtype"):
        if getattr(args, name) not in (None, "auto"):
            kwargs[name] = getattr(args, name)
    return kwargs


def model_kwargs(args: argparse.Namespace) -> dict:
    """How LLM loads the model: a checkpoint (GGUF or Hugging Face), or random weights of a
    named shape."""
    return {"load_format": args.load_format, "model_config": args.model_config}
