"""Logit warping (temperature / top-k / top-p) and sampling.

``warp_probs`` reproduces the warper chain of HF transformers' ``generate`` exactly:
``TemperatureLogitsWarper`` -> ``TopKLogitsWarper`` -> ``TopPLogitsWarper`` -> softmax, computed
in float32. The same function must be applied to the target logits before lossless verification
(``verify.verify_sampling``), so that speculative sampling reproduces the distribution that plain
sampling with these settings would have.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..compile_boundary import compile_boundary
from ..config import check_sampling_args  # (the arguments' check belongs to the settings; re-exported here)

# Vocabularies above this many tokens take the sampled rounds' greedy argmax outside the compiled
# graph (a graph break; eager, the same index): at Gemma 3's 262,144 tokens Inductor fused it with
# the softmax's reductions into a kernel it cannot generate ("NYI TritonSplitDimKernel
# reductions"), and the whole acceptance of every sampled round then ran uncompiled; at 49,152
# (the default model) it compiles
LARGE_VOCAB = 65536

__all__ = ["RowSampling", "Uniforms", "check_sampling_args", "sample", "uniform", "warp_logits", "warp_probs",
           "truncates", "warp_probs_rows", "warp_with"]


def warp_logits(
    logits: torch.Tensor, temperature: float, top_k: Optional[int] = 0, top_p: Optional[float] = 1.0
) -> torch.Tensor:
    """Apply temperature, top-k and top-p (in this order, HF semantics) to ``logits``.

    Args:
        logits: ``[..., V]`` float logits.
        temperature: > 0 (use ``warp_probs`` for the greedy case ``temperature == 0``).
    Returns:
        ``[..., V]`` float32 logits with removed tokens set to ``-inf``.
    """
    check_sampling_args(temperature, top_k, top_p)
    if temperature == 0:
        raise ValueError("warp_logits needs temperature > 0; temperature 0 (greedy) is handled by warp_probs")
    scores = logits.float() / temperature
    vocab = scores.shape[-1]
    if top_k and top_k < vocab:
        # HF TopKLogitsWarper: remove everything strictly below the k-th largest value (ties kept).
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        # HF TopPLogitsWarper: ascending sort, drop the low tail whose cumulative mass <= 1 - top_p.
        sorted_scores, sorted_idx = torch.sort(scores, dim=-1, descending=False)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        sorted_remove = cum <= (1 - top_p)
        sorted_remove[..., -1:] = False  # always keep the most likely token
        remove = sorted_remove.scatter(-1, sorted_idx, sorted_remove)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


def warp_probs(
    logits: torch.Tensor, temperature: float, top_k: Optional[int] = 0, top_p: Optional[float] = 1.0
) -> torch.Tensor:
    """Next-token distribution after temperature / top-k / top-p.

    Args:
        logits: ``[..., V]`` float logits.
        temperature: 0 means greedy: the result is the one-hot of ``argmax`` (first index on ties).
        top_k: keep the ``top_k`` largest logits (0 or None: off).
        top_p: nucleus mass (1.0 or None: off).
    Returns:
        ``[..., V]`` float32 probabilities.
    """
    if torch.is_tensor(temperature):
        return warp_probs_rows(logits, temperature, top_k, top_p)
    check_sampling_args(temperature, top_k, top_p)
    if temperature == 0:
        idx = logits.argmax(dim=-1, keepdim=True)
        return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, idx, 1.0)
    return warp_logits(logits, temperature, top_k, top_p).softmax(dim=-1)


def warp_probs_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: Optional[torch.Tensor],
                    top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """``warp_probs`` with settings per batch row: logits [B, ..., V]; temperature [B] float
    (0 = greedy: the one-hot of the argmax), top_k [B] long (0 = off), top_p [B] float (1 = off).
    The same warpers as transformers, in the same order, with no host synchronisation. top_k and
    top_p None: no row uses them, and their work over the whole vocabulary (two sorts per row) is
    skipped."""
    view = (-1,) + (1,) * (logits.dim() - 1)
    t = temperature.view(view)
    greedy = t == 0
    scores = logits.float() / torch.where(greedy, 1.0, t.float())
    top = _argmax_apart(logits) if logits.shape[-1] > LARGE_VOCAB else logits.argmax(dim=-1, keepdim=True)
    onehot = torch.zeros_like(scores).scatter_(-1, top, 1.0)
    if top_k is None and top_p is None:
        return torch.where(greedy, onehot, scores.softmax(dim=-1))
    k, p = top_k.view(view), top_p.view(view).float()
    return torch.where(greedy, onehot, _truncate_sorting(scores, k, p).softmax(dim=-1))


def _truncate_sorting(scores: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """scores [B, ..., V] with top-k then top-p applied (removed: ``-inf``), ``k``, ``p`` [B, 1, ...]
    per row (0 / 1: off), by sorting the vocabulary."""
    vocab = scores.shape[-1]
    ordered = scores.sort(dim=-1, descending=True).values
    kth = ordered.gather(-1, (k.clamp(1, vocab) - 1).expand(*scores.shape[:-1], 1))
    scores = scores.masked_fill(((k > 0) & (k < vocab)) & (scores < kth), float("-inf"))
    ascending, index = scores.sort(dim=-1)
    # always keep the most likely token (the last); a mask, not an in-place write into the last
    # column, which TorchDynamo (torch 2.11) cannot trace ("list indices must be integers")
    last = torch.arange(vocab, device=scores.device) == vocab - 1
    remove = (_cumsum_apart(ascending.softmax(dim=-1)) <= (1 - p)) & ~last & (p < 1.0)
    return scores.masked_fill(remove.scatter(-1, index, remove), float("-inf"))


@compile_boundary
def _argmax_apart(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1, keepdim=True)`` as its own (uncompiled) operation (see
    :data:`LARGE_VOCAB`)."""
    return logits.argmax(dim=-1, keepdim=True)


@compile_boundary
def _cumsum_apart(probs: torch.Tensor) -> torch.Tensor:
    """``probs.cumsum(dim=-1)`` as its own (uncompiled) operation: Inductor (torch 2.11, CUDA)
    splits a scan over a whole vocabulary for a few rows and fails to generate that code ("list
    indices must be integers or slices, not NoneType"), which left every top-p round's acceptance
    uncompiled."""
    return probs.cumsum(dim=-1)


@dataclass
class RowSampling:
    """Sampling settings per batch row, for an engine whose rows are different requests:
    device tensors read inside the captured rounds. A row with temperature 0 decodes greedily."""

    temperature: torch.Tensor  # [B] float
    top_k: torch.Tensor  # [B] long
    top_p: torch.Tensor  # [B] float
    seed: Optional[int] = None
    # host-side, shared with the row views: {"on": whether some row may use top-k or top-p}. Off,
    # warping skips their sorts; ``set_row`` turns it on for such a row, the engine sets it for
    # each round from its rows (a kind of round of its own: its captured graphs keep the setting)
    truncation: dict = field(default_factory=lambda: {"on": False})
    greedy = False  # the engine samples (greedy rows get one-hot distributions)

    @classmethod
    def zeros(cls, batch: int, device) -> "RowSampling":
        return cls(torch.zeros(batch, device=device), torch.zeros(batch, dtype=torch.long, device=device),
                   torch.ones(batch, device=device))

    @property
    def truncating(self) -> bool:
        return self.truncation["on"]

    @truncating.setter
    def truncating(self, on: bool) -> None:
        self.truncation["on"] = bool(on)

    def rows(self, n: int) -> "RowSampling":
        """The settings of rows ``0..n-1`` (views: later ``set_row`` calls and the truncation
        switch show through)."""
        return RowSampling(self.temperature[:n], self.top_k[:n], self.top_p[:n], self.seed, self.truncation)

    def set_row(self, row: int, temperature: float, top_k: int, top_p: float) -> None:
        check_sampling_args(temperature, top_k, top_p)
        self.temperature[row], self.top_k[row], self.top_p[row] = temperature, top_k or 0, top_p or 1.0
        if truncates(top_k, top_p):
            self.truncating = True


def truncates(top_k: Optional[int], top_p: Optional[float]) -> bool:
    """Whether these settings cut the distribution (top-k or top-p on)."""
    return bool(top_k) or (top_p is not None and top_p < 1.0)


def warp_with(config, logits: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
    """``warp_probs`` of ``logits`` [n, ..., V] with the settings of ``config``: a
    ``GenerationConfig`` (every row), or a :class:`RowSampling`'s rows ``rows`` (top-k and top-p
    left out while its truncation switch is off)."""
    if not isinstance(config, RowSampling):
        return warp_probs(logits, config.temperature, config.top_k, config.top_p)
    if not config.truncating:
        return warp_probs_rows(logits, config.temperature[rows], None, None)
    return warp_probs_rows(logits, config.temperature[rows], config.top_k[rows], config.top_p[rows])


def config_rows(config, n: int):
    """The sampling settings of batch rows ``0..n-1``: a :class:`RowSampling`'s views of them, or
    a ``GenerationConfig`` (shared by every row) as it is."""
    return config.rows(n) if isinstance(config, RowSampling) else config


ROW_DRAW = 1024  # numbers a seeded row's draw takes from its stream (it uses the first it needs)


class RowStream:
    """A seeded row's random numbers. Draw ``c`` of the row's round ``r`` (the draws between two
    refills in which the row draws; its first, the prefill's sample) comes from a generator seeded
    by (seed, r, c), whose first :data:`ROW_DRAW` numbers it takes, using as many as the draw's
    shape needs. So the numbers at a tree node do not depend on how many nodes the batch's round
    has (other rows' proposals make it longer), nor on rounds that run while the row waits: what a
    seeded request samples does not depend on the requests beside it."""

    def __init__(self, seed: int):
        self.seed, self.round, self.call, self.refill = seed, 0, 0, -1

    def draw(self, shape: tuple, refill: int, device) -> torch.Tensor:
        if refill != self.refill:  # the row's first draw since the last refill: its next round
            self.refill, self.round, self.call = refill, self.round + 1, 0
        key = ((self.seed * 1_000_003 + self.round) * 1_000_033 + self.call) % (1 << 63)
        self.call += 1
        n = math.prod(shape)
        numbers = torch.rand(max(n, ROW_DRAW), generator=torch.Generator(device=device).manual_seed(key), device=device)
        return numbers[:n].view(shape)


class Uniforms:
    """The uniform random numbers of a round, drawn from ``generator``. Eager (the default) each
    request draws fresh numbers. For CUDA graphs, ``make_static(count)`` turns it into views of
    one buffer that ``refill`` redraws before every replay, so a captured round consumes new
    numbers each time while its kernels stay the same; ``used`` counts what a round asked for.
    Each set of captured graphs keeps (and puts back before replaying) the buffer it reads.

    Every draw's first dimension is the batch row (``first_row`` + its index). A row given its
    own stream (``seed_row``: a seeded request of a server, :class:`RowStream`) takes its numbers
    from it, so what it samples does not depend on the requests beside it; ``drop_row`` ends that
    when it leaves."""

    def __init__(self, generator: Optional[torch.Generator], device):
        self.generator, self.device = generator, torch.device(device)
        self.buffer: Optional[torch.Tensor] = None
        self.used = 0
        self.first_row = 0  # the batch row of a draw's index 0
        self.row_generators: dict = {}  # batch row -> its own RowStream
        self.refills = 0  # rounds begun (a seeded row's stream counts the rounds it draws in)
        self._layouts: dict = {}  # id(buffer) -> {start: shape} of the draws a captured round reads
        # (start, shape) of this round's eager draws: a sizing run's become the layout of the buffer
        # ``make_static`` makes. Recorded on the eager path only: a captured round's (compiled) draws
        # must not change Python state that compiled code is guarded on (a guard failing between a
        # capture's warm-up and the capture recompiles inside the capture, which then fails)
        self._draws: list = []

    def seed_row(self, row: int, seed: int) -> None:
        """From now on batch row ``row`` draws from its own stream, seeded with ``seed``."""
        self.row_generators[row] = RowStream(seed)

    def drop_row(self, row: int) -> None:
        """Batch row ``row`` draws from the shared generator again."""
        self.row_generators.pop(row, None)

    def __call__(self, shape) -> torch.Tensor:
        n = math.prod(shape)
        start, self.used = self.used, self.used + n
        if self.buffer is None:
            out = torch.rand(shape, generator=self.generator, device=self.device)
            self._draw_rows(out, shape)
            self._draws.append((start, tuple(shape)))
            return out
        # a captured round reads the buffer: ``refill`` puts the own-generator rows' numbers there
        return self.buffer[start:start + n].view(shape)

    def _draw_rows(self, out: torch.Tensor, shape) -> None:
        """Overwrites the numbers of the rows that have their own stream."""
        for row, stream in self.row_generators.items():
            b = row - self.first_row
            if shape and 0 <= b < shape[0]:
                out[b] = stream.draw(tuple(shape[1:]), self.refills, self.device)

    def make_static(self, count: int) -> None:
        """Switches to a new buffer of ``count`` numbers (the one a capture's graphs will read),
        laid out as the draws since the last :meth:`eager` or eager :meth:`refill` (the sizing
        run's)."""
        self.buffer = torch.rand(max(count, 1), generator=self.generator, device=self.device)
        self._layouts[id(self.buffer)] = dict(self._draws)
        self.used = 0

    def eager(self) -> None:
        """Back to drawing fresh numbers on request (for a sizing run before a capture)."""
        self.buffer = None
        self.used = 0
        self._draws.clear()

    def refill(self) -> None:
        """Starts a round: new numbers in the buffer (static) or a new count (eager)."""
        self.refills += 1
        if self.buffer is not None:
            self.buffer.uniform_(0.0, 1.0, generator=self.generator)
            if self.row_generators:
                for start, shape in self._layouts.get(id(self.buffer), {}).items():
                    self._draw_rows(self.buffer[start:start + math.prod(shape)].view(shape), shape)
        else:
            self._draws.clear()
        self.used = 0


def uniform(shape, generator=None, device="cpu") -> torch.Tensor:
    """Uniform numbers in [0, 1) of ``shape`` from a ``torch.Generator`` (or None) or :class:`Uniforms`."""
    if isinstance(generator, Uniforms):
        return generator(tuple(shape))
    return torch.rand(shape, generator=generator, device=device)


def sample(probs: torch.Tensor, generator=None) -> torch.Tensor:
    """Draw one token per row by inverting the cumulative distribution (no host sync, fixed
    shapes: CUDA-graph safe).

    Args:
        probs: ``[B, V]`` (or ``[..., V]``) non-negative weights, each row with positive sum.
        generator: optional ``torch.Generator`` on ``probs.device``, or :class:`Uniforms`.
    Returns:
        ``[B]`` (or ``[...]``) long token ids; a token of weight 0 is never drawn.
    """
    flat = probs.reshape(-1, probs.shape[-1]).float()
    u = uniform(tuple(probs.shape[:-1]), generator, flat.device).reshape(-1)
    return _inverse_cdf(flat, u).reshape(probs.shape[:-1])


@compile_boundary
def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """weights [R, V], u [R] uniform in [0, 1) -> [R]: the first index whose cumulative weight
    reaches ``(1 - u) * total``, as its own (uncompiled) operation: Inductor (torch 2.11) cannot
    generate a cumulative sum over a vocabulary followed by a reduction ("NYI
    TritonSplitDimKernel reductions"), and a sampled round's whole acceptance then ran uncompiled."""
    cdf = weights.cumsum(-1)
    # x in (0, total]: the first index with cdf >= x has positive weight
    x = (1.0 - u) * cdf[:, -1]
    return (cdf < x[:, None]).sum(-1).clamp(max=weights.shape[-1] - 1)
