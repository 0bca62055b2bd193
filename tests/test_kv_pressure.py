"""When KV pages run out, requests wait or are preempted and recomputed: every request still
completes, and (the CPU backend being exact) with the tokens it has alone."""

from __future__ import annotations

from pathlib import Path

from muser import LLM, SamplingParams

PAGE = 16
MAX_TOKENS = 24


def test_a_tiny_page_pool_delays_requests_and_changes_no_token(gguf_path: Path) -> None:
    # 16 pages of 16 rows: one full 256-token context, about two of these requests at once
    llm = LLM(gguf_path, progress=False, device="cpu", max_num_seqs=3, max_model_len=256,
              page_size=PAGE, num_pages=16)
    engine = llm.engine
    prompts = [llm.encode("The tide came in over the stones. " * n) for n in (9, 10, 11)]
    assert all(90 < len(p) + MAX_TOKENS <= 8 * PAGE for p in prompts)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    alone = [llm.generate(p, params).token_ids for p in prompts]
    engine.runner.prefix.reset(engine.runner.pages)  # NOTE: else the prompts resume, cached alone

    reqs = [engine.add_request(p, params) for p in prompts]
    tokens: dict[int, list[int]] = {r.uid: [] for r in reqs}
    fewest_free = engine.runner.pages.num_free
    while engine.has_work:
        for out in engine.step():
            assert out.finish_reason in (None, "length")
            if out.token_id is not None:
                tokens[out.uid].append(out.token_id)
        fewest_free = min(fewest_free, engine.runner.pages.num_free)
    assert engine.scheduler.stats.preemptions >= 1 and fewest_free == 0
    assert [tokens[r.uid] for r in reqs] == alone
    assert engine.runner.pages.num_free == 16
