"""Disaggregated prefill: long prompts prefilled by another process (another box, a GPU) and
their KV installed here, verified, as if prefilled locally (docs/disaggregation.md).

    wire.py      the link over torch.distributed: rendezvous, framing, heartbeats
    snapshot.py  a sequence's KV detached from its pool; export and install
    worker.py    `muser prefill-worker`
    client.py    the serving node's side: workers, verification, outcomes
"""
