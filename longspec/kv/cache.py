"""The caches of a generation, allocated once and never reallocated while decoding: the target's
KV cache (:class:`KVCache`) and the draft's constant-size ring buffer (:class:`DraftCache`).

Every write goes to slots computed on the device from per-row lengths, with shapes that do not
change from step to step, so a step can be captured in a CUDA graph. Finished rows are not
removed: the engine stops advancing them."""
from __future__ import annotations

from typing import Optional, Sequence as Seq

import torch

from ..attention import kv_store
from ..attention.paged import LayerKV, physical_slots, rows_of
from ..compile_boundary import compile_boundary
from ..config import ModelConfig


DEFAULT_BLOCK_SIZE = 256  # tokens per block of a shared pool (a multiple of the kernels' key block)


def token_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of one token's K/V over every layer."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * torch.empty((), dtype=dtype).element_size()


def free_memory(device) -> int:
    """Bytes of memory free now on ``device`` (a CUDA device's, else the machine's available RAM)."""
    device = torch.device(device)
    if device.type == "cuda":  # (with what PyTorch holds cached but unused)
        return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:  # MemAvailable: free pages and the page cache the kernel can reclaim (a loaded model's files)
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def pool_tokens_for(memory: str, config: ModelConfig, dtype: torch.dtype, device) -> int:
    """Tokens of a KV pool of ``memory``: GiB ("8", "8GiB", "0.5G") or a fraction of the memory
    free now ("0.9" or "90%"; a bare number below 1 is a fraction). Raises ValueError."""
    text = memory.strip().lower()
    try:
        if text.endswith("%"):
            size = float(text[:-1]) / 100 * free_memory(device)
        else:
            number = float(text.removesuffix("gib").removesuffix("gb").removesuffix("g"))
            gib = text[-1:] in ("b", "g") or number >= 1
            size = number * (1 << 30) if gib else number * free_memory(device)
    except ValueError:
        raise ValueError(f"KV memory must be GiB (e.g. 8 or 8GiB) or a fraction of free memory (e.g. 0.9 or "
                         f"90%), got {memory!r}") from None
    if not 0 < size < float("inf"):
        raise ValueError(f"KV memory must be more than zero and finite, got {memory!r}")
    free = free_memory(device)
    if size > free:
        raise ValueError(f"{memory!r} is {size / (1 << 30):.1f} GiB, more than the {free / (1 << 30):.1f} GiB free on "
                         f"{torch.device(device).type}")
    return int(size // token_bytes(config, dtype))


def kv_pool_tokens(config: ModelConfig, dtype: torch.dtype, device, max_len: int, memory=None, batch: int = 1,
                   cuda_rows: int = 8) -> Optional[int]:
    """Tokens of an engine's KV pool of ``memory`` (see :func:`pool_tokens_for`; at least one row
    of ``max_len``), or by default on CUDA ``cuda_rows`` rows within a quarter of the free memory
    (None on a CPU: a row per batch row); never fewer than ``batch`` rows."""
    if memory is not None:
        tokens = pool_tokens_for(str(memory), config, dtype, device)
        if tokens < max_len:
            raise ValueError(f"KV memory {memory} holds {tokens} tokens of K/V, less than one row of {max_len}: give "
                             "more memory or a smaller max_len")
    elif torch.device(device).type == "cuda":
        tokens = min(cuda_rows * max_len, free_memory(device) // 4 // token_bytes(config, dtype))
    else:
        return None
    return max(tokens, batch * max_len)


def pool_blocks(config: ModelConfig, dtype: torch.dtype, device, rows: int, row_slots: int, block_size: int,
                pool_tokens: Optional[int] = None, tp=None) -> int:
    """Blocks of ``block_size`` tokens in a KV pool of ``pool_tokens`` tokens (rounded up to whole
    blocks), by default of ``rows`` rows of ``row_slots`` slots each (a multiple of the block
    size), on CUDA within half the device memory free now (at least one block). ``tp``: a
    tensor-parallel group whose ranks all take the smallest of their budgets (``config``: this
    rank's KV heads), so the same requests fit everywhere."""
    if pool_tokens is None and torch.device(device).type == "cuda":  # every row's slots, within half the free memory
        budget = free_memory(device) // 2 // token_bytes(config, dtype)
        if tp is not None:  # one pool size on every rank
            budget = min(tp.gather_objects(budget))
        pool_tokens = None if budget >= rows * row_slots else max(budget, block_size)
    return rows * (row_slots // block_size) if pool_tokens is None else -(-pool_tokens // block_size)


class PoolExhausted(ValueError):
    """The KV block pool has too few free blocks for a request (a server waits; a call fails)."""


class BlockPool:
    """The K/V storage of every target layer, in fixed-size blocks shared by the rows of a cache:
    ``k``, ``v`` [L, Hkv, P, D] with ``P = (num_blocks + 1) * block_size`` slots; slot ``s`` of
    block ``n`` is ``n * block_size + s``. The last block (:attr:`scratch`) is never handed out:
    rows that own no block point there, so their (ignored) writes never touch another row's data.
    Blocks are handed out and returned on the host (:meth:`allocate`, :meth:`release`)."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype=torch.float32, device="cpu",
                 scratch_slots: Optional[int] = None):
        """``scratch_slots``: the scratch block's size (default a whole block, as rows that own
        nothing need; 1 for a pool whose rows own their blocks for good)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        extra = block_size if scratch_slots is None else scratch_slots
        shape = (config.num_layers, config.num_kv_heads, num_blocks * block_size + extra, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._free = [True] * num_blocks
        self._n_free = num_blocks

    @property
    def scratch(self) -> int:
        """The scratch block's id (its first slot: ``scratch * block_size``)."""
        return self.num_blocks

    @property
    def num_free(self) -> int:
        return self._n_free

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def allocate(self, n: int, prefer: Optional[int] = None) -> list:
        """``n`` free blocks, taken: ``prefer .. prefer + n - 1`` when all free, else the lowest run
        of ``n`` consecutive free blocks, else the lowest ``n`` free ones. Raises
        :class:`PoolExhausted` when fewer than ``n`` are free."""
        free = self._free
        if n > self.num_free:
            raise PoolExhausted(f"KV pool exhausted: {n} blocks of {self.block_size} tokens needed, "
                                f"{self.num_free} of {self.num_blocks} free")
        if prefer is not None and prefer + n <= self.num_blocks and all(free[prefer:prefer + n]):
            blocks = list(range(prefer, prefer + n))
        else:
            run, blocks = 0, None
            for i, f in enumerate(free):
                run = run + 1 if f else 0
                if run == n:
                    blocks = list(range(i - n + 1, i + 1))
                    break
            if blocks is None:
                blocks = [i for i, f in enumerate(free) if f][:n]
        for i in blocks:
            free[i] = False
        self._n_free -= n
        return blocks

    def release(self, blocks) -> None:
        for i in blocks:
            if self._free[i]:
                raise RuntimeError(f"KV pool: block {i} released twice")
            self._free[i] = True
            self._n_free += 1


@compile_boundary  # compiled layers call it as it is: in-place, no copy of the layer's storage
def store_kv(k_layer: torch.Tensor, v_layer: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Writes k_new, v_new [B, Hkv, M, D] into one layer of a :class:`BlockPool` (k_layer, v_layer
    [Hkv, P, D]) at physical ``slots`` [B, M] (``KVCache.physical``). On CUDA with Triton, one
    kernel writes both (two indexed copies otherwise)."""
    b = k_new.shape[0]
    k_rows, v_rows = k_layer[None].expand(b, -1, -1, -1), v_layer[None].expand(b, -1, -1, -1)  # batch stride 0
    if k_layer.is_cuda and kv_store.store_fits(k_rows, v_rows, k_new, v_new):
        kv_store.store_kv(k_rows, v_rows, k_new, v_new, slots)
        return
    flat = slots.reshape(-1)
    k_layer[:, flat] = k_new.transpose(0, 1).reshape(k_layer.shape[0], -1, k_layer.shape[-1])
    v_layer[:, flat] = v_new.transpose(0, 1).reshape(v_layer.shape[0], -1, v_layer.shape[-1])


@compile_boundary  # as it is in compiled rounds: Inductor turned this indexed write into a
# view of the cache into two copies of the whole cache (a third of a round at batch 16)
def move_tokens(k: torch.Tensor, v: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copies the K/V of physical slots ``src`` [N] to slots ``dst`` [N] of every layer of a
    :class:`BlockPool`'s ``k``, ``v`` [L, Hkv, P, D]: one gather of the kept tokens, then one
    scatter, so overlapping slots are read before any is written."""
    for store in (k, v):
        store[:, :, dst] = store[:, :, src]


class KVCache:
    """Keys and values of every target layer for a batch of sequences, in a :class:`BlockPool`.

    Row b's logical slot s lives in pool block ``table[b, s // block_size]``; ``lengths`` [B] long:
    row b holds committed tokens in logical slots ``0..lengths[b]-1``. New tokens (a prefill
    chunk, a decode token or a verification tree) are written after them and stay *pending*
    (``pending`` tokens per row, at slots ``lengths[b] + 0..pending-1``) until ``advance`` commits
    a prefix of them, ``commit`` moves chosen ones to consecutive slots after the prefix, or
    ``discard`` drops them. A tree can be grown level by level: each forward sees the pending
    tokens through its tree mask.

    Built alone (``pool`` None) the cache owns a pool of one block of ``max_len`` slots per row,
    each row owning its block for good (dense: the rows are a strided view of the pool). Built
    over a shared ``pool``, each row holds ``max_len / block_size`` table entries; rows own no
    blocks until :meth:`assign` gives them some (an engine admitting a request), and
    :meth:`unassign` returns them. A pool with a block for every row is used densely unless
    ``paged`` (rows that share blocks: a prefix cache). ``allocator`` hands the blocks out, chosen
    here for good: the pool (None), or a :class:`~longspec.kv.prefix_cache.PrefixCache` over it."""

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device="cpu", pool: Optional[BlockPool] = None,
                 paged: bool = False, allocator=None):
        if batch_size < 1 or max_len < 1:
            raise ValueError(f"KV cache needs batch_size >= 1 and max_len >= 1, got {batch_size}, {max_len}")
        if pool is None:  # one block per row, owned for good: a one-slot scratch for stray slots
            pool = BlockPool(config, batch_size, max_len, dtype, device, scratch_slots=1)
        device = pool.k.device
        max_blocks = -(-max_len // pool.block_size)
        self.pool, self.block_size = pool, pool.block_size
        self.max_len = max_blocks * pool.block_size
        home = torch.arange(batch_size * max_blocks, device=device).view(batch_size, max_blocks)
        # dense: the pool holds every row's home blocks, so each row owns them for good
        self.dense = not paged and pool.num_blocks >= batch_size * max_blocks
        self.allocator = pool if allocator is None else allocator
        if self.dense:
            pool.allocate(batch_size * max_blocks, prefer=0)
            self.table = home
        else:
            self.table = torch.full((batch_size, max_blocks), pool.scratch, dtype=torch.long, device=device)
        self.blocks: list = [None] * batch_size  # per row (of this cache; views index it by row0 + row): its blocks
        self.row0 = 0  # the first row's index in the cache this one is a view of
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.pending = 0

    def rows(self, start: int, stop: int) -> "KVCache":
        """A cache over batch rows ``start..stop-1`` sharing this one's pool, table and lengths."""
        view = KVCache.__new__(KVCache)
        view.__dict__.update(self.__dict__)
        view.table, view.lengths = self.table[start:stop], self.lengths[start:stop]
        view.blocks = self.blocks  # shared bookkeeping, indexed by the full cache's rows
        view.row0, view.pending = self.row0 + start, 0
        return view

    @property
    def batch_size(self) -> int:
        return self.table.shape[0]

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    def layer(self, i: int) -> LayerKV:
        """Layer ``i`` (negative: from the last) as attention reads it."""
        return LayerKV(self.pool.k[i], self.pool.v[i], self.table, self.block_size,
                       self.row0 if self.dense else None, self.pool.scratch * self.block_size)

    @property
    def k(self) -> torch.Tensor:
        """Keys of every layer as [L, B, Hkv, S, D] (S = ``max_len``): a view for a dense cache."""
        return self._all_layers(self.pool.k)

    @property
    def v(self) -> torch.Tensor:
        """Values of every layer as [L, B, Hkv, S, D] (see :attr:`k`)."""
        return self._all_layers(self.pool.v)

    def _all_layers(self, store: torch.Tensor) -> torch.Tensor:
        return rows_of(store, self.table, self.block_size, self.row0 if self.dense else None,
                       self.pool.scratch * self.block_size, self.max_len)

    def physical(self, slots: torch.Tensor) -> torch.Tensor:
        """Logical slots [B or 1, M] of these rows -> physical pool slots [B, M] (a slot past a
        row's capacity -> the scratch block)."""
        return physical_slots(self.table, self.block_size, slots, self.pool.scratch * self.block_size)

    def assign(self, row: int, n_slots: int, shared: Seq[int] = ()) -> None:
        """Gives row ``row`` room for ``n_slots`` tokens: blocks from the allocator (its home
        blocks when free), after ``shared`` (blocks of a cached prefix the row already holds: its
        first slots; then the blocks after them when free), or nothing to do for a dense cache. Raises :class:`PoolExhausted` when the
        pool has too few free blocks, ValueError past the row's capacity."""
        if n_slots > self.max_len:
            raise ValueError(f"{n_slots} tokens do not fit a row of the KV cache ({self.max_len} slots)")
        if self.dense:
            return
        self.unassign(row)
        max_blocks = self.table.shape[1]
        fresh = self.allocator.allocate(self.blocks_for(n_slots) - len(shared),
                                        prefer=shared[-1] + 1 if shared else (self.row0 + row) * max_blocks)
        blocks = [*shared, *fresh]
        self.blocks[self.row0 + row] = blocks
        entries = torch.full((max_blocks,), self.pool.scratch, dtype=torch.long)
        entries[:len(blocks)] = torch.tensor(blocks)
        self.table[row].copy_(entries)

    def blocks_for(self, n_slots: int) -> int:
        """Pool blocks :meth:`assign` takes for ``n_slots`` tokens (none for a dense cache)."""
        return 0 if self.dense else max(1, -(-n_slots // self.block_size))

    def unassign(self, row: int) -> None:
        """Returns row ``row``'s blocks to the pool (a dense cache's rows keep theirs)."""
        if self.dense or self.blocks[self.row0 + row] is None:
            return
        self.allocator.release(self.blocks[self.row0 + row])
        self.blocks[self.row0 + row] = None
        self.table[row].fill_(self.pool.scratch)

    def check_room(self, n_new: int, longest: Optional[int] = None) -> None:
        """Raises a clear error if ``n_new`` more tokens do not fit in every row (``longest``:
        ``lengths.max()`` when the caller has it already, saving a device sync)."""
        need = (int(self.lengths.max()) if longest is None else longest) + self.pending + n_new
        if need > self.max_len:
            raise ValueError(f"KV cache full: {need} tokens needed, the cache holds {self.max_len}")

    def new_slots(self, count: int) -> torch.Tensor:
        """[B, count] logical slots of ``count`` new tokens written after the pending ones."""
        offsets = torch.arange(self.pending, self.pending + count, device=self.lengths.device)
        return self.lengths[:, None] + offsets[None, :]

    def advance(self, n: torch.Tensor) -> None:
        """Commits the first ``n[b]`` pending tokens of each row (n [B] long)."""
        self.lengths += n
        self.pending = 0

    def discard(self) -> None:
        """Drops the pending tokens."""
        self.pending = 0

    def commit(self, nodes: torch.Tensor, n: torch.Tensor) -> None:
        """Keeps pending tokens ``nodes[b, :n[b]]`` (indices into the pending block, increasing;
        [B, K] long, padding ignored) of every layer: moves them to slots
        ``lengths[b] + 0..n[b]-1`` (one gather and one scatter over all layers), advances the
        lengths by ``n`` and drops the rest. ``n[b] = 0`` leaves row b as it is."""
        k = nodes.shape[1]
        cols = torch.arange(k, device=nodes.device)[None, :]
        keep = cols < n[:, None]
        src = self.physical(self.lengths[:, None] + torch.where(keep, nodes, cols))
        dst = self.physical(self.lengths[:, None] + cols)
        move_tokens(self.pool.k, self.pool.v, src.reshape(-1), dst.reshape(-1))
        self.advance(n)


class DraftCache:
    """Ring buffer of the draft's self-attention K/V for a batch: ``R = window + tree_size``
    slots, independent of the context length (plus one scratch slot that absorbs the writes of
    padding tokens, so every write has a fixed shape).

    Token with sequence index ``i`` (its slot in the target cache) is stored in slot ``i % R``.
    ``slot_index`` [B, R+1] records which index a slot holds (-1: empty), ``slot_node`` [B, R+1]
    marks pending tree nodes (their node number; -1 for committed tokens). A committed query at
    index ``i`` sees committed keys ``i-W+1..i``; a pending tree node sees those below its index plus
    the pending nodes its tree mask allows."""

    def __init__(self, config, batch_size: int, tree_size: int, dtype, device):
        """``config``: the draft's (``window``, ``num_kv_heads``, ``head_dim``)."""
        self.window, self.size = config.window, config.window + tree_size
        shape = (batch_size, config.num_kv_heads, self.size + 1, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.slot_index = torch.full((batch_size, self.size + 1), -1, dtype=torch.long, device=device)
        self.slot_node = torch.full((batch_size, self.size + 1), -1, dtype=torch.long, device=device)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.k, self.v, self.slot_index, self.slot_node))

    def rows(self, start: int, stop: int) -> "DraftCache":
        """A ring over batch rows ``start..stop-1`` sharing this one's storage."""
        view = DraftCache.__new__(DraftCache)
        view.window, view.size = self.window, self.size
        view.k, view.v = self.k[start:stop], self.v[start:stop]
        view.slot_index, view.slot_node = self.slot_index[start:stop], self.slot_node[start:stop]
        return view

    def write(self, k, v, index, node, valid, slot=None):
        """k, v [B, Hkv, T, D]; index, node [B, T] (node -1: committed); valid [B, T] bool;
        ``slot`` [B, T] (default ``index``) picks ring slot ``slot % R``: a pending node n of a tree
        whose root has index r uses ``r + n``, so the nodes of one tree never collide. Invalid
        tokens go to the scratch slot, which is never visible."""
        slot = torch.where(valid, (index if slot is None else slot) % self.size, self.size)
        rows = torch.arange(k.shape[0], device=k.device)[:, None].expand_as(slot)
        self.k.transpose(1, 2)[rows, slot] = k.transpose(1, 2)
        self.v.transpose(1, 2)[rows, slot] = v.transpose(1, 2)
        self.slot_index[rows, slot] = torch.where(valid, index, -1)
        self.slot_node[rows, slot] = torch.where(valid, node, -1)

    def visibility(self, index, node, tree_mask):
        """Mask [B, T, R+1] for queries at ``index`` [B, T] (node [B, T], -1 for committed ones);
        tree_mask [B, T, N] over tree nodes (rows of committed queries are ignored)."""
        si, sn = self.slot_index[:, None, :], self.slot_node[:, None, :]
        q = index[..., None]
        committed = (sn < 0) & (si >= 0) & (si <= q) & (si > q - self.window)
        if tree_mask is None:
            return committed
        seen = tree_mask.gather(2, sn.clamp(min=0).expand(-1, q.shape[1], -1))
        return committed | ((sn >= 0) & (node[..., None] >= 0) & seen)

    def drop_pending(self):
        pending = self.slot_node >= 0
        self.slot_index.masked_fill_(pending, -1)
        self.slot_node.masked_fill_(pending, -1)

    def clear_row(self, row: int) -> None:
        """Empties row ``row`` (a new sequence takes it)."""
        self.slot_index[row] = -1
        self.slot_node[row] = -1
