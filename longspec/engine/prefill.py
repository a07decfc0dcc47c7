"""Prompt prefill in fixed-size chunks, shaped like the engine's rounds.

An eager prefill launches ~50 operations per layer from Python whatever the prompt's length, so a
small model's prefill is launch-bound, and in a server every running stream waits for each
arriving request's prefill. :class:`ChunkedPrefill` runs a prompt as chunks of a fixed number of
tokens, each one forward over a fixed number of cache slots with a causal mask, then commits the
chunk's real tokens: on CUDA each row's chunk step is captured once as a CUDA graph (through
:class:`~longspec.engine.runner.PhaseRunner`, like a round), so a prefill is a few replays. The
K/V and the last token's logits are the eager prefill's (up to kernel rounding).

A ladder of chunk sizes (``sizes``, default :func:`default_sizes`: the big chunk, 1/8, 1/16 and
1/32 of it, e.g. 2048, 256, 128 and 64 tokens) keeps a prompt's last piece from running a whole
padded big chunk: a 30-token question after a cached 32k-token document, or a short prompt, runs
one 64-token step, not a 2048-token one. After a long cached prefix each padded query still
attends over every cached key, so the rungs are close together (hence the 1/16 rung).
:func:`chunk_plan` splits a prompt: big chunks while at least a big chunk remains, then the rest
in the ladder's chunks that minimise the slots computed (real and padding) plus a fixed cost per
step (``step_cost`` slots, default a quarter of the big chunk: a step's weight reads and
launches); with a 2048 / 256 / 128 / 64 ladder a rest of up to 64 tokens goes in one 64-token
chunk, up to 128 in one 128, up to 256 in one 256, up to 768 in two or three smaller chunks, and
more in one big chunk. That step cost sits between a small model's (launch-bound: fewer steps
win) and an 8B model's (its weights' read, ~200 tokens' compute: small steps win). Each size has
one chunk step, captured once, which serves every row: it runs on a one-row view of the cache
whose block table and length are buffers of its own, loaded with a row's before its steps (its
length copied back after); the small sizes' static buffers and graphs are small.

The chunk's mask is causal and the Triton kernel is told so: it computes the mask and skips the
key blocks after each query tile's last token, so the tree part of a chunk costs half as much and
chunks can be long.

The replays are one row at a time, so a large admission is cheaper as one batched eager forward:
an admission that needs more than :attr:`ChunkedPrefill.max_chunks` chunk steps in all is
prefilled eagerly.

Two eager modes (``mode``) to compare on long prompts, where a chunk's launches are negligible:
``"sdpa"``, chunks of ``chunk`` tokens through :meth:`TargetModel.prefill` (PyTorch's fused
attention, lower-right causal after the first chunk), and ``"layers"``,
:func:`~longspec.models.layer_prefill.prefill_by_layer` (one causal attention call per layer
over the whole prompt, projections and MLP ``chunk`` tokens at a time). ``benchmarks/bench_long.py
--prefill`` times them against the captured chunks.

Long prompts go layer by layer in the captured mode too: a row's prompt (after its cached tokens)
of :attr:`ChunkedPrefill.by_layer_from` tokens or more is prefilled by ``prefill_by_layer``, whose
one causal attention call per layer runs on cuDNN's fused attention (first in
:data:`~longspec.attention.fast.CAUSAL_BACKENDS`): past a length between 16k and 32k tokens it is
the faster of the two. A process's first cuDNN attention call sets cuDNN up and its first of each
kind of length (a multiple of 128 or not) builds a kernel, which an engine's warm-up pays
(:meth:`ChunkedPrefill.prepare_by_layer`; a ``Generator`` leaves it to its first prompt by layer);
each new prompt length still builds a plan. Only targets whose layers all see every earlier
token go by layer (:func:`~longspec.models.layer_prefill.supports`: not Gemma 3's sliding-window
layers). A prompt by layer needs no padded slots and no chunk-step count, so any prompt that fits
the cache (1M tokens included) goes in one pass. The measurements behind these choices:
docs/benchmarks.md ("The measurements behind the code's choices")."""
from __future__ import annotations

import functools
from collections import Counter
from typing import Optional, Sequence

import torch

from ..kv.cache import KVCache
from ..models import layer_prefill
from ..models.layer_prefill import prefill_by_layer
from ..spec.sampling import Uniforms
from ..spec.tokens import token_tensor
from .runner import PhaseRunner


MODES = ("captured", "sdpa", "layers")
MIN_CHUNK = 16  # the default ladder's smallest chunk: a shorter step saves nothing measurable


def default_sizes(chunk: int) -> tuple:
    """The default ladder for a big chunk of ``chunk`` tokens, ascending: ``chunk``, ``chunk // 8``,
    ``chunk // 16`` and ``chunk // 32``, the small ones only from :data:`MIN_CHUNK` tokens
    (2048 -> 64, 128, 256, 2048; 1024 -> 32, 64, 128, 1024; 16 -> 16)."""
    return tuple(sorted({chunk} | {s for s in (chunk // 8, chunk // 16, chunk // 32) if s >= MIN_CHUNK}))


@functools.lru_cache(maxsize=16)
def _rest_choices(sizes: tuple, step_cost: int) -> tuple:
    """For every rest ``r`` below the biggest of ``sizes`` (ascending), the first chunk of the
    cheapest way to run it: ``cost[r] = min over s of s + step_cost + cost[max(r - s, 0)]``
    (ties: the bigger chunk, fewer steps)."""
    cost, first = [0], [0]
    for r in range(1, sizes[-1]):
        best = min(reversed(sizes), key=lambda s: s + step_cost + cost[max(r - s, 0)])
        cost.append(best + step_cost + cost[max(r - best, 0)])
        first.append(best)
    return tuple(first)


def chunk_plan(n_tokens: int, sizes: Sequence[int], step_cost: int, room: Optional[int] = None) -> Optional[list]:
    """The chunk sizes, in order, that prefill ``n_tokens`` tokens with the ladder ``sizes``
    (ascending): big chunks while at least one big chunk remains, then the rest in the chunks that
    minimise slots computed plus ``step_cost`` per step (biggest first). ``room``: slots the
    chunks may cover (the cache's after the tokens it holds); when the cheapest plan's padding
    does not fit, the one that pads least (each step the biggest chunk the rest fills, then the
    smallest chunk: less than the smallest chunk padded); None when neither fits. Every step
    holds at least one real token."""
    big = sizes[-1]
    plan = [big] * (n_tokens // big)
    rest, choices = n_tokens % big, _rest_choices(tuple(sizes), step_cost)
    tail = []
    while rest > 0:
        tail.append(choices[rest])
        rest -= choices[rest]
    plan += sorted(tail, reverse=True)
    if room is None or sum(plan) <= room:
        return plan
    plan, rest = [], n_tokens
    while rest >= sizes[0]:
        plan.append(max(s for s in sizes if s <= rest))
        rest -= plan[-1]
    plan += [sizes[0]] if rest else []
    return plan if sum(plan) <= room else None


class _ChunkInputs:
    """A chunk step's static inputs for chunks of ``size`` tokens: ``ids`` [1, size] (zero
    padded), ``steps`` [size] (offsets from the row's length) and the causal mask [1, size, size]."""

    def __init__(self, size: int, device: torch.device):
        self.ids = torch.zeros(1, size, dtype=torch.long, device=device)
        self.steps = torch.arange(size, device=device)
        self.causal = (self.steps[:, None] >= self.steps[None, :])[None]


class ChunkedPrefill:
    """Prefills rows of ``cache`` (the engine's) in chunks of ``chunk`` tokens and the smaller
    ones of its ladder (``chunk``: the big chunk's tokens, its ladder :func:`default_sizes`; or the
    ladder itself, a sequence of sizes), attending over ``n_keys`` slots (None: the slots in use,
    on a CPU). ``step_cost``: a step's fixed cost in slots for :func:`chunk_plan` (default a
    quarter of the big chunk). ``cuda_graphs``: capture each (row, size) chunk step on its first
    use (or at :meth:`prepare`). ``mode``: ``"captured"`` (fixed-shape chunk steps, the default),
    or one of the eager modes of the module docstring (``"sdpa"``, ``"layers"``: chunks of the
    big size, no ladder), which capture nothing. :attr:`steps_run` counts the chunk steps run per
    size."""

    max_chunks = 64  # an admission needing more chunk steps than this goes as one eager forward
    by_layer_from = 24576  # captured mode: a row's prompt of this many tokens or more goes layer by layer
    layer_piece = 16384  # its projections and MLP this many tokens at a time
    # :meth:`prepare_by_layer`'s prompts: cuDNN's fused attention builds a kernel of its own (once a
    # process, a fraction of a second) for lengths that are multiples of 128 and another for the rest
    warm_tokens = (257, 2048)

    def __init__(self, target, cache: KVCache, chunk, n_keys, cuda_graphs: bool, causal_kernel: bool = True,
                 mode: str = "captured", step_cost: Optional[int] = None):
        sizes = default_sizes(chunk) if isinstance(chunk, int) else tuple(sorted(set(chunk)))
        if not sizes or not all(1 <= s <= cache.max_len for s in sizes):
            raise ValueError(f"prefill chunks must be 1 to {cache.max_len} tokens (the cache's slots), got {chunk}")
        if mode not in MODES:
            raise ValueError(f"unknown prefill mode {mode!r}; expected one of {MODES}")
        if mode == "layers":
            layer_prefill.check_supported(target.config)
        self.target, self.cache, self.n_keys, self.mode = target, cache, n_keys, mode
        self.sizes = sizes if mode == "captured" else sizes[-1:]
        self.chunk = sizes[-1]  # the big chunk
        self.step_cost = self.chunk // 4 if step_cost is None else step_cost
        self.cuda_graphs = cuda_graphs
        # tell the attention that the chunk's mask is causal (False: the Triton kernel reads it,
        # as for a tree; ``bench_prefill.py`` compares both)
        self.causal_kernel = causal_kernel
        device = target.device
        self.inputs = {s: _ChunkInputs(s, device) for s in self.sizes} if mode == "captured" else {}
        self.real = torch.ones(1, dtype=torch.long, device=device)  # the chunk's real tokens
        self.logits = torch.zeros(1, target.config.vocab_size, dtype=torch.float32, device=device)
        self.uniforms = Uniforms(None, device)  # draws none: keeps the engine's seeded stream untouched
        self.runners: dict = {}  # {size: its chunk step}
        # the row a chunk step runs on: a one-row view of the cache whose block table and length are
        # its own buffers, loaded with a row's before its steps and its length copied back after, so
        # one chunk step (one CUDA graph) per size serves every row
        self.step_row = cache.rows(0, 1)
        self.step_row.table, self.step_row.lengths = cache.table[:1].clone(), cache.lengths[:1].clone()
        # read through the table (the row it stands for changes): the Triton kernels read the pool in
        # place; PyTorch's attention (sdpa, matmul) gathers the row's keys for each chunk
        self.step_row.dense = False
        self.steps_run: Counter = Counter()
        self.by_layer_ready = False  # :meth:`prepare_by_layer` done

    def plan(self, n_tokens: int, start: int = 0) -> Optional[list]:
        """The chunk sizes that prefill ``n_tokens`` after ``start`` tokens in the cache
        (:func:`chunk_plan`), or None when they cannot go in chunks: the last chunk's padded slots
        do not fit the cache, or the RoPE depends on the prompt's length (dynamic NTK). Eager
        modes: one entry per big chunk, unpadded; a prompt :meth:`by_layer`: none (no chunk step)."""
        room = self.cache.max_len - start
        if self.by_layer(n_tokens):  # no chunk steps, no padding, any RoPE
            return [] if n_tokens <= room else None
        if self.mode != "captured":
            return [self.chunk] * -(-n_tokens // self.chunk) if n_tokens <= room else None
        if self.target.config.rope.rope_type == "dynamic":
            return None
        return chunk_plan(n_tokens, self.sizes, self.step_cost, room)

    def fits(self, n_tokens: int, start: int = 0) -> bool:
        """Whether ``n_tokens`` after ``start`` tokens in the cache can go in chunks (:meth:`plan`)."""
        return self.plan(n_tokens, start) is not None

    def takes(self, lengths: list, starts: Optional[list] = None) -> bool:
        """Whether prompts of ``lengths`` tokens (after ``starts`` cached tokens, default none),
        admitted together, go in chunks: each one :meth:`fits`, and together they need at most
        :attr:`max_chunks` chunk steps."""
        plans = [self.plan(n, s) for n, s in zip(lengths, starts or [0] * len(lengths))]
        return None not in plans and sum(map(len, plans)) <= self.max_chunks

    def by_layer(self, n_tokens: int) -> bool:
        """Whether a prompt of ``n_tokens`` (after the row's cached tokens) goes layer by layer."""
        return self.mode == "layers" or (self.mode == "captured" and n_tokens >= self.by_layer_from
                                         and layer_prefill.supports(self.target.config))

    def __call__(self, row: int, prompt: list, start: Optional[int] = None) -> torch.Tensor:
        """Prefills ``prompt`` into row ``row`` after the ``start`` tokens it holds (default: read
        from the cache) -> logits [1, V] after its last token. Raises ValueError when it does not
        :meth:`fit <fits>`."""
        ids = token_tensor(prompt, self.real.device)  # one copy to the device
        if self.mode == "sdpa":
            return self.target.prefill(ids[None], torch.full((1,), len(prompt), device=ids.device),
                                       self.cache.rows(row, row + 1), chunk_size=self.chunk)
        if self.by_layer(len(prompt)):
            piece = self.chunk if self.mode == "layers" else self.layer_piece
            return prefill_by_layer(self.target, ids[None], self.cache.rows(row, row + 1), piece=piece)
        start = int(self.cache.lengths[row]) if start is None else start
        plan = self.plan(len(prompt), start)
        if plan is None:
            raise ValueError(f"a prompt of {len(prompt)} tokens after {start} does not go in chunks of {self.sizes} "
                             f"into {self.cache.max_len} cache slots")
        self._load(row)
        at = 0
        for size in plan:
            part = ids[at:at + size]
            inputs = self.inputs[size]
            inputs.ids.zero_()
            inputs.ids[0, :len(part)] = part
            self.real.fill_(len(part))
            self.runner(size).run_round()
            self.steps_run[size] += 1
            at += size
        self.cache.lengths[row:row + 1].copy_(self.step_row.lengths)
        return self.logits.clone()

    def _load(self, row: int) -> None:
        """The chunk steps run on row ``row`` from now on (its block table and length loaded)."""
        self.step_row.table.copy_(self.cache.table[row:row + 1])
        self.step_row.lengths.copy_(self.cache.lengths[row:row + 1])
        self.step_row.pending = 0  # (a step that failed part-way leaves none behind for the next row)

    @property
    def captured(self) -> bool:
        """Whether chunks run as (prepared, on CUDA captured) chunk steps: :meth:`runner`."""
        return self.mode == "captured"

    def prepare(self, row: int) -> None:
        """Prepares (on CUDA captures) the chunk step of every size on row ``row`` (holding no
        sequence: a step's warm-up runs write past its length); one chunk step per size serves
        every row, so this is done once."""
        if any(size not in self.runners for size in self.sizes):
            self._load(row)
            for size in self.sizes:
                self.runner(size).prepare()

    def prepare_by_layer(self, row: int = 0) -> None:
        """On CUDA, where a prompt may go layer by layer, runs short prompts by layer into row
        ``row`` (holding no sequence; their blocks taken from the pool's free ones, never evicting
        a cached prefix, and given back) once (:func:`layer_prefill.warm_up`: cuDNN's
        set-up, and its kernels for both kinds of length, :attr:`warm_tokens`), which the first
        such prompts would pay."""
        if self.cuda_graphs and not self.by_layer_ready and self.by_layer(self.cache.max_len):
            free = self.cache.max_len if self.cache.dense else self.cache.pool.num_free * self.cache.block_size
            lengths = sorted({min(n, self.cache.max_len, free) for n in self.warm_tokens} - {0})
            for tokens in lengths:  # (none when no block is free now: a later warm-up tries again)
                self.cache.assign(row, tokens)
                try:
                    layer_prefill.warm_up(self.target, self.cache.rows(row, row + 1), tokens)  # (drops its tokens)
                finally:
                    self.cache.unassign(row)
            self.by_layer_ready = bool(lengths)

    def runner(self, size: Optional[int] = None) -> PhaseRunner:
        """The chunk step for chunks of ``size`` tokens (default the big chunk), on the row last
        loaded (:meth:`_load`), created, and captured on CUDA, on first use."""
        if not self.captured:
            raise ValueError(f"prefill mode {self.mode!r} runs eagerly: it has no chunk steps")
        size = self.chunk if size is None else size
        if size not in self.runners:
            cache, inputs = self.step_row, self.inputs[size]

            def chunk_step():
                positions = cache.lengths[:, None] + inputs.steps[None, :]
                hidden = self.target.forward_hidden(inputs.ids, positions, cache, inputs.causal,
                                                    causal=self.causal_kernel, n_keys=self.n_keys)
                last = hidden.gather(1, (self.real - 1).view(1, 1, 1).expand(1, 1, hidden.shape[-1]))[:, 0]
                self.logits.copy_(self.target.logits(last))
                cache.advance(self.real)  # the padding stays pending: dropped

            self.runners[size] = PhaseRunner([chunk_step], [cache.lengths], self.uniforms, self.target.device,
                                                  self.cuda_graphs, timed=False, reset=cache.discard)
        return self.runners[size]
