"""One Sequence per request: the object the scheduler counts is the one the runner places and
commits, so its cached rows, pages and prefix ids agree after every step, preemptions
included."""

from __future__ import annotations

from pathlib import Path

from muser import LLM, SamplingParams
from muser.core import Status

PAGE = 16


def test_the_scheduled_sequence_is_the_placed_one(gguf_path: Path) -> None:
    llm = LLM(gguf_path, progress=False, device="cpu", max_num_seqs=3, max_model_len=256,
              page_size=PAGE, num_pages=16)
    engine = llm.engine
    prompts = [llm.encode("The tide came in over the stones. " * n) for n in (9, 10, 11)]
    reqs = [engine.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True))
            for p in prompts]
    while engine.has_work:
        engine.step()
        for seq in engine.live.values():
            queued = engine.scheduler.running + list(engine.scheduler.waiting)
            assert any(seq is other for other in queued)
            assert len(seq.page_ids) == -(-seq.num_cached // PAGE)
            assert seq.token_ids == seq.all_ids[:seq.num_cached]
            assert seq.is_placed or (seq.num_cached == 0 and seq.status == Status.WAITING)
    assert engine.scheduler.stats.preemptions >= 1
    assert all(r.status == Status.FINISHED and not r.is_placed for r in reqs)
