"""Draft-model speculation (`--speculative draft`) is exact: every token and logit is plain
decoding's, greedy and seeded, whether the draft is the target itself (every draft holds) or
a model unlike it (many drafts fail); the draft's own KV, its sliding ring wrapping under
those rejections, stays the draft model's plain KV of the sequence; a draft whose vocabulary
is not the target's is refused at startup, naming the difference."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import pytest
import torch

from bench.synth_gguf import write
from muser import LLM, SamplingParams
from muser.engine.draft_model import DraftModel
from muser.engine.speculation import accepted
from muser.errors import ConfigError
from muser.sampler import BatchSampler
from muser.sequence import Sequence
from tests.test_cli import _muser
from tests.test_speculative import _kv_rows, _serve, _workload
from tests.tiny_gguf import CFG

K = 4
# NOTE: the tiny Gemma 3 shape (2 layers: one sliding, window 8, one global), with a
# vocabulary of byte tokens the tokenizer needs and room for 256 positions
TINY = dataclasses.replace(CFG, vocab_size=512, max_position_embeddings=256)
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]


def _tokenizer(path: Path, rename: dict[int, str] | None = None, bos: int = 2) -> Path:
    """A tokenizer GGUF of TINY.vocab_size tokens: 4 specials, the 256 byte tokens, words
    (`rename`: other texts at some ids)."""
    tokens = SPECIALS + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"w{i}" for i in range(TINY.vocab_size - len(tokens))]
    types = [3, 3, 3, 2] + [6] * 256 + [1] * (TINY.vocab_size - 260)
    for i, text in (rename or {}).items():
        tokens[i] = text
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The target (bf16 weights) and drafts: its own weights as Q4_0 (close to it, not
    equal), other weights (seed 1), and its weights under another tokenizer."""
    d = tmp_path_factory.mktemp("tiny")
    tok = _tokenizer(d / "tokenizer.gguf")
    other = _tokenizer(d / "renamed.gguf", rename={300: "w-renamed"})
    return {"target": write(TINY, "bf16", tok, d / "target.gguf"),
            "q4": write(TINY, "q4_0", tok, d / "q4.gguf"),
            "renamed": write(TINY, "bf16", other, d / "renamed-model.gguf"),
            "bos": write(TINY, "bf16", _tokenizer(d / "bos.gguf", bos=0), d / "bos-model.gguf")}


TINY_KW = {"progress": False, "device": "cpu", "max_num_seqs": 4, "max_model_len": 256,
           "page_size": 16}


def _tiny_params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=120, ignore_eos=True),
            SamplingParams(max_tokens=100, ignore_eos=True, temperature=0.9, top_p=0.95,
                           seed=7, repeat_penalty=1.1, presence_penalty=0.2, logprobs=2),
            SamplingParams(max_tokens=90, ignore_eos=True, temperature=1.0, top_k=50, seed=2)]


def test_a_draft_unlike_the_target_fails_often_and_outputs_stay_plain_decodings(
        tiny: dict[str, Path]) -> None:
    plain = LLM(tiny["target"], **TINY_KW)
    spec = LLM(tiny["target"], speculative="draft", speculative_model=str(tiny["q4"]),
               num_speculative_tokens=K, **TINY_KW)
    prompts = [[2, 300, 301, 302], [2, 400, 401], [2, 500, 310, 320, 330]]
    params, arrivals = _tiny_params(), [0, 1, 2]
    want = _serve(plain, prompts, params, arrivals)
    steps = []
    got = _serve(spec, prompts, params, arrivals, steps)
    stats = spec.engine.speculation.stats
    assert stats.drafted > stats.accepted > 0, (stats.drafted, stats.accepted)
    assert any(v >= 2 for v, _, _ in steps)  # several sequences verified in one step
    for (tokens, rows), (want_tokens, want_rows) in zip(got, want):
        assert tokens == want_tokens
        assert all(torch.equal(a, b) for a, b in zip(rows, want_rows))
    # NOTE: each request's draft slot went back with it
    assert sorted(spec.draft.free_slots) == list(range(TINY_KW["max_num_seqs"]))
    assert spec.draft.pages.num_free == spec.draft.pages.num_pages


def test_the_drafts_kv_is_its_plain_kv_while_its_ring_wraps_under_rejections(
        tiny: dict[str, Path]) -> None:
    """Drive the proposer as the engine does (propose, a verify pass's accepted prefix and
    token after it, propose again): after each step the draft's attendable K/V rows are
    bitwise those of the draft model decoding the same ids plainly."""
    target = LLM(tiny["target"], **TINY_KW)
    draft = LLM(tiny["q4"], speculative="ngram", num_speculative_tokens=K, prefix_cache=False,
                **TINY_KW)
    reference = LLM(tiny["q4"], prefix_cache=False, **TINY_KW).runner
    # NOTE: sampled (greedy, these random weights soon repeat one token the draft gets right)
    prompt, steps = [2, 300, 301, 302], 150
    p = SamplingParams(max_tokens=steps, ignore_eos=True, temperature=0.5, seed=5)
    truth = target.generate(prompt, p).token_ids
    proposer = DraftModel(draft.runner, BatchSampler("cpu"))
    seq = Sequence(list(prompt), dataclasses.replace(p, max_tokens=steps + K + 2), seed=5)
    ref = reference.allocate()
    rejected = 0
    while len(seq.output_ids) < steps - K - 1:
        at = len(seq.output_ids)
        drafts = proposer.propose(seq, K)
        n = accepted(drafts, truth[at:])  # the verify pass's tokens: plain decoding's
        rejected += n < len(drafts)
        seq.output_ids += truth[at:at + n + 1]
        kv = proposer._in_step(seq)  # the rows of drafts that failed dropped
        ids = seq.context_ids[:kv.num_cached]
        reference.forward([ref], [ids[ref.num_cached:]])
        assert kv.ids == ids
        assert all(torch.equal(a, b) for a, b in zip(_kv_rows(draft.runner, kv),
                                                     _kv_rows(reference, ref)))
        assert len(kv.page_ids) == -(-kv.num_cached // draft.runner.engine.page_size)
    assert rejected > 10 and kv.ring.logical_origin > 0  # many rejections, the ring wrapped
    proposer.forget(seq)
    assert seq.draft is None and draft.runner.pages.num_free == draft.runner.pages.num_pages


@pytest.fixture(scope="module")
def self_drafting(gguf_path: Path) -> tuple[LLM, LLM]:
    kw = {"progress": False, "device": "cpu", "max_num_seqs": 4, "max_model_len": 2048}
    return LLM(gguf_path, **kw), LLM(gguf_path, speculative="draft",
                                     speculative_model="gemma3-270m",
                                     num_speculative_tokens=K, **kw)


def test_the_270m_drafting_for_itself_holds_every_draft(
        self_drafting: tuple[LLM, LLM]) -> None:
    """The embedded 270M as its own draft: its drafts are the target's own draws (the same
    logits bitwise, the same noise), so every draft holds, greedy and sampled, and the
    outputs are plain decoding's, beside a prompt prefilled in chunks."""
    plain, spec = self_drafting
    prompts, params, arrivals = _workload(plain)
    want = _serve(plain, prompts, params, arrivals)
    stats = spec.engine.speculation.stats
    steps = []
    got = _serve(spec, prompts, params, arrivals, steps)
    assert stats.drafted == stats.accepted > 100, (stats.drafted, stats.accepted)
    assert any(v and prefill for v, _, prefill in steps), steps
    for (tokens, rows), (want_tokens, want_rows) in zip(got, want):
        assert tokens == want_tokens
        assert all(torch.equal(a, b) for a, b in zip(rows, want_rows))


def test_seeded_sampling_with_a_draft_repeats_run_to_run(tiny: dict[str, Path]) -> None:
    spec = LLM(tiny["target"], speculative="draft", speculative_model=str(tiny["q4"]),
               num_speculative_tokens=K, **TINY_KW)
    p = SamplingParams(max_tokens=80, ignore_eos=True, temperature=1.0, seed=123)
    runs = [spec.generate([2, 300, 301], p) for _ in range(3)]
    assert runs[0].token_ids == runs[1].token_ids == runs[2].token_ids
    assert runs[0].draft_tokens > runs[0].accepted_tokens > 0
    other = spec.generate([2, 300, 301], dataclasses.replace(p, seed=124))
    assert other.token_ids != runs[0].token_ids


@pytest.mark.parametrize("draft, needle", [
    ("renamed", "token 300 is 'w40' in the target, 'w-renamed' in the draft"),
    ("bos", "bos_id: the target's is 2, the draft's 0"),
])
def test_a_draft_with_another_vocabulary_is_refused(tiny: dict[str, Path], draft: str,
                                                    needle: str) -> None:
    with pytest.raises(ConfigError, match="its tokenizer is not the target's") as info:
        LLM(tiny["target"], speculative="draft", speculative_model=str(tiny[draft]),
            **TINY_KW)
    assert needle in str(info.value)


def test_a_draft_of_another_model_family_is_refused(gguf_path: Path,
                                                    tiny: dict[str, Path]) -> None:
    with pytest.raises(ConfigError) as info:
        LLM(gguf_path, speculative="draft", speculative_model=str(tiny["target"]),
            progress=False, device="cpu", max_num_seqs=1, max_model_len=256)
    # NOTE: the first difference named: Gemma's <end_of_turn> (106) ends a turn, and the tiny
    # vocabulary has none
    assert "its tokenizer is not the target's (eot_ids: the target's is [1, 106], the draft's" \
        " [1])" in str(info.value)


def test_generate_json_counts_a_draft_models_drafts(tiny: dict[str, Path]) -> None:
    args = ("generate", "--model", str(tiny["target"]), "--device", "cpu", "--max-tokens",
            "40", "--ignore-eos", "--json", "--max-model-len", "256", "--temperature", "0.5",
            "--seed", "5")
    plain = _muser(*args, stdin="w1 w2 w3")
    spec = _muser(*args, "--speculative", "draft", "--speculative-model", str(tiny["q4"]),
                  stdin="w1 w2 w3")
    assert plain.returncode == spec.returncode == 0, spec.stderr
    plain, spec = json.loads(plain.stdout), json.loads(spec.stdout)
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["draft_tokens"] > spec["accepted_tokens"] > 0
