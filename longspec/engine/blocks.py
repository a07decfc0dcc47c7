"""Which KV blocks each row of an :class:`~longspec.engine.engine.Engine` holds: the block manager.

A sequence joins with the pool blocks it can use (its prompt, ``max_new_tokens`` and one round's
writes: :meth:`BlockManager.need`), less the cached blocks its prompt starts with where the engine
has a prefix cache (:meth:`~BlockManager.hits`: they are shared, not copied); it leaves giving
them back, its full blocks first indexed by content so that a later prompt can start from them.
The allocator (the pool itself, or the prefix cache over it, which evicts idle cached blocks
when fresh ones run out) is the cache's, chosen when the engine is built. The
:class:`~longspec.engine.scheduler.Scheduler` asks it whether sequences fit; admission asks it
for their blocks."""
from __future__ import annotations

from typing import Optional

from ..kv.cache import KVCache
from ..kv.prefix_cache import Hit, PrefixCache
from .sequence import Sequence, cache_need


class BlockManager:
    """The blocks of ``cache``'s rows (``prefix``: its prefix cache, or None); ``round_slots``:
    cache slots one round writes (the decode token, or the engine's biggest tree)."""

    def __init__(self, cache: KVCache, prefix: Optional[PrefixCache], round_slots: int):
        self.cache, self.prefix, self.round_slots = cache, prefix, round_slots
        self.pool = cache.pool

    def need(self, s: Sequence) -> int:
        """Cache slots sequence ``s`` can use (prompt, new tokens, one round's writes: one for a
        sequence with room for plain rounds only)."""
        return cache_need(len(s.prompt), s.max_new_tokens, 1 if s.plain_rounds else self.round_slots)

    def blocks_for(self, s: Sequence) -> int:
        """Pool blocks ``s`` takes in all (cached ones included; none for a dense cache)."""
        return self.cache.blocks_for(self.need(s))

    def hits(self, seqs: list) -> list:
        """Per sequence, the cached blocks its prompt starts with (none without a prefix cache)."""
        return [self.prefix.match(s.prompt, s.cache_namespace) if self.prefix is not None else Hit([]) for s in seqs]

    def blocks_needed(self, seqs: list, hits: Optional[list] = None) -> int:
        """Fresh pool blocks that ``seqs`` take when they join (0 for a dense pool: rows own
        theirs), besides the cached blocks their prompts start with (``hits``)."""
        hits = self.hits(seqs) if hits is None else hits
        return sum(self.blocks_for(s) - len(h.blocks) for s, h in zip(seqs, hits))

    def pinned(self, hit: Hit) -> set:
        """The idle cached blocks a sequence whose prompt starts with ``hit`` holds when it joins
        (they then cannot be evicted for fresh blocks; none without a prefix cache)."""
        return self.prefix.pinned([hit]) if self.prefix is not None else set()

    @property
    def num_free(self) -> int:
        """Blocks the allocator can hand out now (idle cached ones included)."""
        return self.cache.allocator.num_free

    def fits(self, fresh: int, pinned: set) -> bool:
        """Whether ``fresh`` blocks can be handed out now while the idle cached blocks ``pinned``
        are held (they are not evicted for them)."""
        return fresh <= self.num_free - len(pinned)

    def can_admit(self, seqs: list, hits: Optional[list] = None) -> bool:
        """Whether the pool has the blocks for ``seqs`` now; ``hits``: their :meth:`hits` (default:
        matched now)."""
        hits = self.hits(seqs) if hits is None else hits
        pinned = self.prefix.pinned(hits) if self.prefix is not None else set()
        return self.fits(self.blocks_needed(seqs, hits), pinned)

    def allocate(self, row0: int, seqs: list, hits: Optional[list] = None) -> None:
        """Gives rows ``row0..`` the blocks of ``seqs`` (the cached blocks of their ``hits`` held
        first, then fresh ones), setting each one's ``cached_tokens``."""
        rows = range(row0, row0 + len(seqs))
        if self.prefix is None:
            for row, s in zip(rows, seqs):
                self.cache.assign(row, self.need(s))
        else:
            self.prefix.assign(self.cache, rows, seqs, [self.need(s) for s in seqs], hits)

    def index(self, row: int, s: Sequence) -> None:
        """Indexes the prompt's full blocks in row ``row`` (prefilled): requests arriving now may
        share them."""
        if self.prefix is not None:
            self.prefix.register(self.cache.blocks[row], s.prompt, indexed=s.cached_tokens // self.pool.block_size,
                                 namespace=s.cache_namespace)

    def free(self, row: int, s: Optional[Sequence] = None) -> None:
        """Row ``row``'s blocks go back (its length reset, so later rounds' writes stay inside the
        cache); ``s``: the sequence that leaves it, whose committed tokens with known ids are
        indexed first (not those cut off after a stop string)."""
        if s is not None and self.prefix is not None:
            self.prefix.register(self.cache.blocks[row], (s.prompt + s.tokens)[:int(self.cache.lengths[row])],
                                 last=True, indexed=s.cached_tokens // self.pool.block_size,
                                 namespace=s.cache_namespace)
        self.cache.lengths[row] = 0
        self.cache.unassign(row)
