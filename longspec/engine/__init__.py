"""Rounds over rows: the engine that runs speculative (or plain) rounds for the sequences it holds
over one KV block pool: each sequence's state, admission and prefill, the phases of a round
captured in CUDA graphs, switching trees, warm-up. What a round proposes and verifies is
``longspec.spec``'s; which tree to run, ``longspec.decoding``'s."""
