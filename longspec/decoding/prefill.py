"""Prompt prefill in fixed-size chunks, shaped like the engine's rounds.

An eager prefill launches ~50 operations per layer from Python whatever the prompt's length: on
the H200 a random-weight SmolLM2-shaped target took ~15 ms for 256 tokens as for 1700
(``benchmarks/results/prefill_compiled_h200.log``), and in a server every running stream waits
for each arriving request's prefill. :class:`ChunkedPrefill` runs a prompt as chunks of a fixed
number of tokens, each one forward over a fixed number of cache slots with a causal mask, then
commits the chunk's real tokens: on CUDA each row's chunk step is captured once as a CUDA graph
(through :class:`~longspec.decoding.runner.PhaseRunner`, like a round), so a prefill is a few
replays. The K/V and the last token's logits are the eager prefill's (up to kernel rounding).

The chunk's mask is causal and the Triton kernel is told so: it computes the mask and skips the
key blocks after each query tile's last token, so the tree part of a chunk costs half as much and
chunks can be long. On the H200 (``bench_prefill_causal_h200.log``, SmolLM2 shape, 4096 slots) a
1700-token prompt took 11.2 ms in 256-token chunks with a read mask, 4.9 ms in 1024-token causal
chunks, and 23 ms as one eager prefill; a 256-token prompt 1.7 ms in a 256 chunk, 2.4 ms in a
1024 one.

The replays are one row at a time, so a large admission is cheaper as one batched eager forward:
on the H200 (SmolLM2, prompts of ~1700 tokens, 256-token chunks; ``serve_chunk_h200.log``) the
chunks made a plain server 1.26x faster at one client (time to first token 48 -> 18 ms) and 1.16x
at four, were even at sixteen (waves of 16 arrivals) and 0.78x at 64 (waves of 64). So an
admission that needs more than :attr:`ChunkedPrefill.max_chunks` chunk steps in all is prefilled
eagerly.

Two eager modes (``mode``) to compare on long prompts, where a chunk's launches are negligible:
``"sdpa"``, chunks of ``chunk`` tokens through :meth:`TargetModel.prefill` (PyTorch's fused
attention, lower-right causal after the first chunk), and ``"layers"``,
:func:`~longspec.models.layer_prefill.prefill_by_layer` (one causal attention call per layer
over the whole prompt, projections and MLP ``chunk`` tokens at a time). ``benchmarks/bench_long.py
--prefill`` times them against the captured chunks.

Long prompts go layer by layer in the captured mode too: a row's prompt (after its cached tokens)
of :attr:`ChunkedPrefill.by_layer_from` tokens or more is prefilled by ``prefill_by_layer``, whose
one causal attention call per layer runs on cuDNN's fused attention (first in
:data:`~longspec.attention.fast.CAUSAL_BACKENDS`). On the H200 (``long_8b_h200.log``, an 8B shape,
bf16) a 32k prompt took 1.58 s in captured 2048-token chunks and 1.33 s by layer, 128k 16.2 s and
11.4 s (transformers' sdpa prefill: 1.73 s and 17.3 s); on the SmolLM2 shape (``long_smol_h200.log``)
both took 34 ms at 7.6k tokens, and at 2k the chunks 6.7 ms against 39 ms. A prompt by layer also
needs no padded slots and no chunk-step count, so any prompt that fits the cache (1M tokens
included) goes in one pass."""
from __future__ import annotations

import torch

from ..cache import KVCache
from ..models.layer_prefill import grouped_causal_attention, prefill_by_layer
from .runner import PhaseRunner
from .sampling import Uniforms


MODES = ("captured", "sdpa", "layers")


class ChunkedPrefill:
    """Prefills rows of ``cache`` (the engine's) ``chunk`` tokens at a time, attending over
    ``n_keys`` slots (None: the slots in use, on a CPU). ``cuda_graphs``: capture each row's chunk
    step on its first use. ``mode``: ``"captured"`` (fixed-shape chunk steps, the default), or one
    of the eager modes of the module docstring (``"sdpa"``, ``"layers"``), which capture nothing."""

    max_chunks = 64  # an admission needing more chunk steps than this goes as one eager forward
    by_layer_from = 8192  # captured mode: a row's prompt of this many tokens or more goes layer by layer
    layer_piece = 16384  # its projections and MLP this many tokens at a time

    def __init__(self, target, cache: KVCache, chunk: int, n_keys, cuda_graphs: bool, causal_kernel: bool = True,
                 mode: str = "captured"):
        if not 1 <= chunk <= cache.max_len:
            raise ValueError(f"prefill chunk must be 1 to {cache.max_len} tokens (the cache's slots), got {chunk}")
        if mode not in MODES:
            raise ValueError(f"unknown prefill mode {mode!r}; expected one of {MODES}")
        self.target, self.cache, self.chunk, self.n_keys, self.mode = target, cache, chunk, n_keys, mode
        self.cuda_graphs = cuda_graphs
        # tell the attention that the chunk's mask is causal (False: the Triton kernel reads it,
        # as for a tree; ``bench_prefill.py`` compares both)
        self.causal_kernel = causal_kernel
        device = target.device
        self.ids = torch.zeros(1, chunk, dtype=torch.long, device=device)  # the chunk (zero padded)
        self.real = torch.ones(1, dtype=torch.long, device=device)  # its real tokens
        self.logits = torch.zeros(1, target.config.vocab_size, dtype=torch.float32, device=device)
        self.steps = torch.arange(chunk, device=device)
        self.causal = (self.steps[:, None] >= self.steps[None, :])[None]
        self.uniforms = Uniforms(None, device)  # draws none: keeps the engine's seeded stream untouched
        self.runners: dict = {}

    def fits(self, n_tokens: int, start: int = 0) -> bool:
        """Whether ``n_tokens`` after ``start`` tokens in the cache can go in chunks: the last
        chunk's padded slots fit the cache, and the RoPE does not depend on the prompt's length
        (dynamic NTK)."""
        if self.mode != "captured" or self.by_layer(n_tokens):  # eager: no padding, any RoPE
            return start + n_tokens <= self.cache.max_len
        last_start = start + (n_tokens - 1) // self.chunk * self.chunk
        return last_start + self.chunk <= self.cache.max_len and self.target.config.rope.rope_type != "dynamic"

    def takes(self, lengths: list, starts: list) -> bool:
        """Whether prompts of ``lengths`` tokens (after ``starts`` cached tokens), admitted
        together, go in chunks: each one :meth:`fits`, and together they need at most
        :attr:`max_chunks` chunk steps."""
        steps = sum(-(-n // self.chunk) for n in lengths if not self.by_layer(n))
        return steps <= self.max_chunks and all(self.fits(n, s) for n, s in zip(lengths, starts))

    def by_layer(self, n_tokens: int) -> bool:
        """Whether a prompt of ``n_tokens`` (after the row's cached tokens) goes layer by layer."""
        return self.mode == "layers" or (self.mode == "captured" and n_tokens >= self.by_layer_from)

    def __call__(self, row: int, prompt: list) -> torch.Tensor:
        """Prefills ``prompt`` into row ``row`` after the tokens it holds -> logits [1, V] after
        its last token."""
        ids = torch.tensor(prompt, dtype=torch.long, device=self.ids.device)  # one copy to the device
        if self.mode == "sdpa":
            return self.target.prefill(ids[None], torch.full((1,), len(prompt), device=ids.device),
                                       self.cache.rows(row, row + 1), chunk_size=self.chunk)
        if self.by_layer(len(prompt)):
            piece = self.chunk if self.mode == "layers" else self.layer_piece
            return prefill_by_layer(self.target, ids[None], self.cache.rows(row, row + 1), piece=piece)
        runner = self.runner(row)
        for start in range(0, len(prompt), self.chunk):
            part = ids[start:start + self.chunk]
            self.ids.zero_()
            self.ids[0, :len(part)] = part
            self.real.fill_(len(part))
            runner.run_round()
        return self.logits.clone()

    def prepare_by_layer(self) -> None:
        """On CUDA, one causal attention call of a prompt by layer's shape on zeros, so that the
        first long prompt does not pay cuDNN's start in this process (its fused attention's
        first call: about 0.8 s on the H200, ``long_8b_h200.log``); nothing is written."""
        c = self.target.config
        n = self.by_layer_from if self.mode == "captured" else self.chunk
        if self.target.device.type != "cuda" or self.mode == "sdpa" or n > self.cache.max_len:
            return
        q = torch.zeros(1, n, c.num_heads, c.head_dim, dtype=self.target.dtype, device=self.target.device)
        kv = q.new_zeros(1, c.num_kv_heads, n, c.head_dim)
        grouped_causal_attention(q, kv, kv)

    @property
    def captured(self) -> bool:
        """Whether chunks run as (prepared, on CUDA captured) chunk steps: :meth:`runner`."""
        return self.mode == "captured"

    def runner(self, row: int) -> PhaseRunner:
        """The chunk step of row ``row`` (created, and captured on CUDA, on first use)."""
        if not self.captured:
            raise ValueError(f"prefill mode {self.mode!r} runs eagerly: it has no chunk steps")
        if row not in self.runners:
            cache = self.cache.rows(row, row + 1)

            def chunk_step():
                positions = cache.lengths[:, None] + self.steps[None, :]
                hidden = self.target.forward_hidden(self.ids, positions, cache, self.causal, causal=self.causal_kernel,
                                                    n_keys=self.n_keys)
                last = hidden.gather(1, (self.real - 1).view(1, 1, 1).expand(1, 1, hidden.shape[-1]))[:, 0]
                self.logits.copy_(self.target.logits(last))
                cache.advance(self.real)  # the padding stays pending: dropped

            self.runners[row] = PhaseRunner([chunk_step], [cache.lengths], self.uniforms, self.target.device,
                                            self.cuda_graphs, timed=False, reset=cache.discard)
        return self.runners[row]
