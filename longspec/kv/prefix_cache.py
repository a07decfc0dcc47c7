"""A prefix cache over the KV block pool: a prompt whose first tokens were seen before (the same
long document with another question, the next turn of a chat) reuses their K/V and prefills only
the rest.

Full blocks of the pool are indexed by their content: a block holding tokens ``t`` after the
blocks of node ``p`` is node ``(p, t)`` of a tree of token blocks (the key is exact: no hash can
collide). A request takes the longest chain of cached blocks that its prompt starts with
(:meth:`PrefixCache.match`), reference-counted (:meth:`acquire`), and prefills only the tokens
after them; its prompt's full blocks are indexed after its prefill, and its generated text's when
it ends (:meth:`register`). A block that no request holds stays cached, least recently used first
out when the pool needs blocks (:meth:`allocate`); blocks in use are never evicted. A block
is shared only whole: where the prompt goes on into a cached block only part of the way (the
document's last block, followed by another question), that block's first tokens are copied into
the row's own first block (copy on write: one copy of at most ``block_size - 1`` tokens' K/V,
every layer, taken before the admission allocates, so that block need not be held) and the
prefill starts after them. At least the prompt's last token is always
computed: its logits give the first new token.

What a hit keeps exact:

* the target's K/V of a token depend only on the tokens before it and its position, which a
  cached block shares with the new prompt (a block is only matched at the same position, after
  the same blocks). Not with dynamic NTK RoPE, whose base depends on the prompt's length: engines
  of such models do not cache prefixes;
* the proposers get their state from the prompt's tokens alone (``Proposer.add``): the LongSpec
  draft rebuilds its window from the prompt's last W tokens (their K/V from the token embeddings
  only, exact for a one-block draft, ``LongSpecDraft.window_kv``), the lookup its history; the
  StreamingLLM drafter reads the target's cache each round. None needs the target's hidden states
  of the cached tokens, so a hit recomputes nothing for the draft;

so a request's output is the same with and without a hit (up to the rounding of matrix products
whose shapes differ, as between any two prefills of one prompt).

Paged rows: a row that reuses cached blocks reads its K/V through its block table, so an engine
with a prefix cache keeps every row paged (``KVCache(paged=True)``). On CUDA the Triton kernels
of the rounds read through the table either way (one table load per 64-key block); the eager
prefill's PyTorch attention, and every step on a CPU, gathers the rows' K/V through the table
instead of viewing them in place (``LayerKV.dense``): a copy of the slots in use per layer and
step (docs/benchmarks.md, "Prefix cache")."""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from .cache import BlockPool, PoolExhausted

ROOT = -1  # the parent of a prompt's first block
PREFIX_BLOCK_SIZE = 64  # an engine's default block size with a prefix cache: the kernels' key block


def root(namespace=None):
    """The parent of a prompt's first block in ``namespace`` (None: the shared one): requests of
    different namespaces (tenants: API keys, cache salts) never share a block, so none can learn
    from another's hits what that one's prompts hold."""
    return ROOT if namespace is None else ("root", namespace)


def common_prefix(a, b) -> int:
    """How many first items sequences ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@dataclass
class Hit:
    """What a prompt finds in the cache: ``blocks`` holding its first tokens, whole, then
    (``partial``) a block whose first ``partial_tokens`` tokens are its next ones, or None."""

    blocks: list
    partial: Optional[int] = None
    partial_tokens: int = 0

    def tokens(self, block_size: int) -> int:
        return len(self.blocks) * block_size + self.partial_tokens


@dataclass
class CachedBlock:
    """A pool block indexed by content: ``node`` its id in the tree of token blocks, ``key``
    (parent node, its tokens)."""

    node: int
    key: tuple


class PrefixCache:
    """The prefix index of a :class:`~longspec.kv.cache.BlockPool` and the allocator of its blocks
    (see the module docstring). ``allocate`` / ``release`` / ``num_free`` are what a
    :class:`~longspec.kv.cache.KVCache` calls on its allocator."""

    def __init__(self, pool: BlockPool):
        self.pool, self.block_size = pool, pool.block_size
        self.index: dict = {}  # (parent node, tokens) -> block id
        self.children: dict = {}  # node -> its children's block ids
        self.blocks: dict = {}  # block id -> CachedBlock (indexed blocks only)
        self.refs: dict = {}  # block id -> rows holding it (every block handed out)
        self.idle: OrderedDict = OrderedDict()  # indexed blocks no row holds, least recently used first
        self._nodes = itertools.count()
        self.prompt_tokens = 0  # over the admitted requests
        self.hit_tokens = 0
        self.evicted = 0
        # what ``match`` found for recent prompts while the index stayed the same (a server matches a
        # waiting request to see whether it fits, then admits it: one walk of a 128k prompt, not two)
        self.version = 0  # bumped whenever the index changes
        self._matched: dict = {}  # id(prompt) -> (prompt, its length, Hit), found at version _matched_at
        self._matched_at = 0

    # ---- the allocator ---------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks a request can take: free ones and cached ones no row holds (evicted on demand)."""
        return self.pool.num_free + len(self.idle)

    def allocate(self, n: int, prefer: Optional[int] = None) -> list:
        """``n`` fresh blocks (as :meth:`BlockPool.allocate`), evicting the least recently used
        idle cached blocks while the pool has too few free. Raises PoolExhausted."""
        if n > self.num_free:
            raise PoolExhausted(f"KV pool exhausted: {n} blocks of {self.block_size} tokens needed, "
                                f"{self.num_free} of {self.pool.num_blocks} free or evictable")
        while self.pool.num_free < n:
            self._evict()
        blocks = self.pool.allocate(n, prefer)
        for b in blocks:
            self.refs[b] = 1
        return blocks

    def release(self, blocks) -> None:
        """A row lets go of ``blocks``: an indexed one no row holds any more stays cached (the
        chain's last blocks first out), another goes back to the pool."""
        for b in reversed(list(blocks)):
            if b not in self.refs:
                raise RuntimeError(f"KV pool: block {b} released twice")
            self.refs[b] -= 1
            if self.refs[b] == 0:
                del self.refs[b]
                if b in self.blocks:
                    self.idle[b] = None
                else:
                    self.pool.release([b])

    def _evict(self, block: Optional[int] = None) -> None:
        """Evicts idle block ``block`` (default: the least recently used)."""
        if block is None:
            block, _ = self.idle.popitem(last=False)
        else:
            del self.idle[block]
        cached = self.blocks.pop(block)
        self.version += 1
        del self.index[cached.key]
        self.children.get(cached.key[0], set()).discard(block)  # (none left if the parent went first)
        self.children.pop(cached.node, None)  # its children are unreachable now: they age out
        self.pool.release([block])
        self.evicted += 1

    # ---- the index ---------------------------------------------------------------------------
    def _keys(self, tokens: list, n_blocks: int):
        size = self.block_size
        return (tuple(tokens[i * size:(i + 1) * size]) for i in range(n_blocks))

    def match(self, prompt: list, namespace=None) -> "Hit":
        """The cached blocks holding the longest prefix of ``prompt`` in whole blocks, then the
        cached block after them that starts with most of the prompt's next tokens (its first
        tokens are copied, not shared), leaving at least the prompt's last token to compute, among
        the blocks of ``namespace`` (see :func:`root`). Nothing is taken: see :meth:`acquire`. (A
        prompt list must not change in place while it waits to be admitted: what was found for it
        is reused while the index is unchanged.)"""
        if self._matched_at != self.version:
            self._matched, self._matched_at = {}, self.version
        seen = self._matched.get((id(prompt), namespace))
        if seen is not None and seen[0] is prompt and seen[1] == len(prompt):
            return seen[2]
        found, parent = [], root(namespace)
        for tokens in self._keys(prompt, (len(prompt) - 1) // self.block_size):
            block = self.index.get((parent, tokens))
            if block is None:
                break
            found.append(block)
            parent = self.blocks[block].node
        rest = prompt[len(found) * self.block_size:len(prompt) - 1]
        best, common = None, 0
        for block in self.children.get(parent, ()):
            cached = self.blocks[block].key[1]  # (fewer than block_size tokens: a row's last block)
            n = common_prefix(cached, rest)
            if n > common:
                best, common = block, n
        if len(self._matched) >= 64:
            self._matched.clear()
        hit = Hit(found, best, common)
        self._matched[id(prompt), namespace] = (prompt, len(prompt), hit)
        return hit

    def acquire(self, blocks: list) -> None:
        """A row holds ``blocks`` (from :meth:`match`) from now on: they cannot be evicted."""
        for b in blocks:
            self.idle.pop(b, None)
            self.refs[b] = self.refs.get(b, 0) + 1

    def assign(self, cache, rows, seqs: list, needs: list, hits: Optional[list] = None) -> None:
        """Gives rows ``rows`` of ``cache`` (a :class:`~longspec.kv.cache.KVCache` allocating from
        this cache) room for ``seqs`` (``needs`` slots each): the cached blocks each prompt
        starts with, held before any fresh block is allocated (so no allocation evicts them), then
        fresh blocks; sets each sequence's ``cached_tokens`` and indexes nothing yet (see
        :meth:`register`). On an error the held blocks of rows not assigned yet are let go (the
        caller unassigns the others). ``hits``: each prompt's :meth:`match`, if nothing changed the
        cache since (default: matched now)."""
        hits = [self.match(s.prompt) for s in seqs] if hits is None else hits
        for h in hits:  # all held first: a block one prompt holds is never another's to take over
            self.acquire(h.blocks)
        for h in hits:
            if h.partial in self.idle and h.partial - 1 in h.blocks[-1:] and \
                    not self.children.get(self.blocks[h.partial].node):
                # the last block of the text a row goes on from (a chat's next turn): the row takes it
                # over, so its blocks stay consecutive (a CPU reads a lone such row in place) and its
                # tokens need no copy. (An evicted or allocated block keeps its K/V until written.)
                self._evict(h.partial)
        done, moves = 0, []
        try:
            for row, s, need, hit in zip(rows, seqs, needs, hits):
                cache.assign(row, need, shared=hit.blocks)
                if hit.partial is not None:  # its first tokens into the row's first fresh block
                    moves.append((hit.partial, cache.blocks[cache.row0 + row][len(hit.blocks)], hit.partial_tokens))
                s.cached_tokens = hit.tokens(self.block_size)
                done += 1
        except BaseException:
            for hit in hits[done:]:
                self.release(hit.blocks)
            raise
        self.copy_slots(moves)
        for s in seqs:
            self.prompt_tokens += len(s.prompt)
            self.hit_tokens += s.cached_tokens

    def copy_slots(self, moves: list) -> None:
        """For each ``(source, target, n)``: block ``source``'s first ``n`` slots (every layer's K
        and V) into block ``target``'s, every source read before any target is written (a source
        may be another move's target); a block onto itself costs nothing. (A block's slots are
        consecutive: slices, no index tensors.)"""
        moves = [m for m in moves if m[0] != m[1]]
        targets = {target for _, target, _ in moves}
        size, pool = self.block_size, self.pool
        read = []
        for source, _, n in moves:
            k, v = (x[:, :, source * size:source * size + n] for x in (pool.k, pool.v))
            read.append((k.clone(), v.clone()) if source in targets else (k, v))
        for (k, v), (_, target, n) in zip(read, moves):
            pool.k[:, :, target * size:target * size + n] = k
            pool.v[:, :, target * size:target * size + n] = v

    def pinned(self, hits: list) -> set:
        """The idle blocks among ``hits`` (from :meth:`match`): a request that takes them cannot
        evict them for its fresh blocks."""
        return {b for h in hits for b in h.blocks if b in self.idle}

    def register(self, blocks: list, tokens: list, last: bool = False, indexed: int = 0, namespace=None) -> None:
        """Indexes a row's full blocks: ``blocks`` hold ``tokens`` in order (the row's committed
        tokens whose ids are known); ``last``: the partly filled block after them too (a row that
        has ended: nothing writes it any more; a later prompt can only copy from it). A block
        whose content is cached in another block already stays unindexed (it goes back to the
        pool when released). ``indexed``: the first blocks are known to be indexed under these
        tokens (the cached blocks the row holds since its admission): they are not walked again.
        ``namespace``: the row's (see :func:`root`)."""
        parent, size = root(namespace), self.block_size
        self.version += 1
        if indexed and blocks[indexed - 1] in self.blocks:
            parent = self.blocks[blocks[indexed - 1]].node
            blocks, tokens = blocks[indexed:], tokens[indexed * size:]
        for block, key_tokens in zip(blocks, self._keys(tokens, -(-len(tokens) // size) if last else len(tokens) // size)):
            key = (parent, key_tokens)
            cached = self.index.get(key)
            if cached is None:
                known = self.blocks.get(block)
                if known is not None:
                    # indexed after another row's block of the same tokens (this row's copy was left
                    # unindexed), which was evicted since: the same tokens after the same tokens, moved here
                    if known.key[1] != key_tokens:
                        raise RuntimeError(f"KV pool: block {block} indexed with other tokens")
                    del self.index[known.key]
                    self.children.get(known.key[0], set()).discard(block)
                    known.key = key
                else:
                    self.blocks[block] = CachedBlock(next(self._nodes), key)
                self.index[key] = cached = block
                self.children.setdefault(parent, set()).add(block)
            parent = self.blocks[cached].node

    def stats(self) -> dict:
        """Blocks of the pool (total, free, cached: indexed ones, held or idle) and the hit rate
        (prompt tokens read from the cache over all admitted prompt tokens)."""
        return {"blocks_total": self.pool.num_blocks, "blocks_free": self.pool.num_free,
                "blocks_cached": len(self.blocks), "blocks_cached_idle": len(self.idle),
                "block_size": self.block_size, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.hit_tokens, "evicted_blocks": self.evicted,
                "hit_rate": round(self.hit_tokens / self.prompt_tokens, 4) if self.prompt_tokens else 0.0}
