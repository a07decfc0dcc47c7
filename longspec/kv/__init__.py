"""The target's K/V: ``cache`` (one preallocated pool of fixed-size blocks per engine, rows read
through block tables; a step's K/V written in one launch) and ``prefix_cache`` (finished
prompts' blocks kept and found again by exact token keys, evicted least recently used)."""
