"""Which waiting sequences join an :class:`~longspec.engine.engine.Engine`'s rows, and when.

The :class:`Scheduler` is the only place that decides admission: first come, first served, while
the engine has a free row and its KV pool the blocks a sequence can use; a sequence that must
wait holds back those behind it (a long prompt is not starved by short ones). Nothing running is
preempted: a sequence keeps its row and blocks until it is done or cancelled, and the engine
releases them after the round that finished it. A caller's loop over an engine reads::

    scheduler.submit(seqs)
    while scheduler.has_work:
        engine.add(scheduler.schedule())   # admit: prefill the sequences that join now
        engine.step()                      # one round; finished sequences leave

(``Generator.generate`` submits one call's prompts; the server's worker submits requests as they
arrive and admits between rounds.)"""
from __future__ import annotations

from collections import deque

from ..kv.cache import PoolExhausted
from .sequence import Sequence


class Scheduler:
    """The waiting sequences of ``engine`` (see the module docstring). Not thread-safe: a server
    calls it under its own lock."""

    def __init__(self, engine):
        self.engine = engine
        self.waiting: deque = deque()

    def submit(self, seqs: list) -> None:
        """Queues ``seqs`` (in order) after those waiting. Raises ValueError, queueing none, for a
        sequence that could never join (see ``Engine.check``)."""
        for s in seqs:
            self.engine.check(s)
        self.waiting.extend(seqs)

    def drop(self, seq: Sequence) -> bool:
        """Takes a waiting sequence off the queue (cancelled before it joined); False if it was
        not waiting (it runs or has left: ``Engine.cancel`` ends it)."""
        for i, s in enumerate(self.waiting):
            if s is seq:
                del self.waiting[i]
                return True
        return False

    @property
    def has_work(self) -> bool:
        """Sequences wait or run."""
        return bool(self.waiting) or self.engine.has_active

    def schedule(self) -> list:
        """The waiting sequences that join now, taken off the queue in order: as many as there
        are free rows while the pool has their blocks (each prompt matched against the prefix
        cache once; the test of ``BlockManager.can_admit`` over them all, in one pass). Raises
        :class:`~longspec.kv.cache.PoolExhausted` when the first one cannot join although
        nothing runs (blocks pinned by no sequence: only an engine used outside this scheduler
        can leave them)."""
        engine, blocks, admit = self.engine, self.engine.blocks, []
        free_rows = len(engine.free_rows())
        fresh, pinned = 0, set()  # (the blocks those admitted take: one pass, not one per sequence)
        while self.waiting and len(admit) < free_rows:
            s = self.waiting[0]
            hit, = blocks.hits([s])
            more, pins = blocks.blocks_needed([s], [hit]), pinned | blocks.pinned(hit)
            if not blocks.fits(fresh + more, pins):
                if not admit and not engine.has_active:
                    raise PoolExhausted(f"KV pool exhausted with no sequence running: a prompt of {len(s.prompt)} "
                                        f"tokens needs {more} blocks, {engine.pool.num_free} of "
                                        f"{engine.pool.num_blocks} are free")
                break  # it waits for running sequences to leave, and those behind it with it
            fresh, pinned = fresh + more, pins
            admit.append(self.waiting.popleft())
        return admit
