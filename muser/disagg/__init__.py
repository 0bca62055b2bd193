"""Disaggregated prefill: long prompts prefilled by another process (another box, a GPU) and
their KV installed here, verified, as if prefilled locally (docs/disaggregation.md).

    wire.py      the link over torch.distributed: rendezvous, framing, heartbeats
    worker.py    `muser prefill-worker`
    client.py    the serving node's side: workers, verification, outcomes; an admission
                 source the engine takes requests' prefills from (muser/engine/source.py)

A sequence's KV detached from its pool (export, install) is muser/kvcache/snapshot.py.
"""
