"""The generation loop.

:class:`Engine` owns everything a batch of sequences needs while decoding: the target's KV cache
(``max_batch`` rows of ``max_len`` slots, allocated once), the proposer's state, the step's
static inputs and outputs, and the captured CUDA graphs. ``Engine.step()`` advances every active
sequence by one round (autoregressive: one token; speculative: propose a tree -> verify it in one
target forward -> accept -> commit the accepted K/V), with fixed shapes and no host
synchronisation until it reads the round's tokens, once. Sequences join (``add``) and leave
between rounds without reallocating anything: a finished row is only masked (their admission:
:mod:`~longspec.engine.admission`).

:class:`~longspec.decoding.generator.Generator` is the public API: ``generate`` is a thin loop
over an engine."""
from __future__ import annotations

import weakref
from collections import deque
from functools import partial
from typing import Optional, Sequence as Seq

import torch

from ..attention import triton_kernels
from ..kv.cache import BlockPool, DEFAULT_BLOCK_SIZE, pool_blocks
from ..kv.prefix_cache import PREFIX_BLOCK_SIZE, PrefixCache
from ..models.compiled import compile_step
from ..models.target import TargetModel
from ..spec.drafting import Proposer
from ..spec.sampling import RowSampling, Uniforms, config_rows, sample, truncates, warp_with
from ..spec.tree import TreeSpec
from ..spec.verify import verify_greedy, verify_sampling
from .admission import Admission
from .blocks import BlockManager
from .prefill import ChunkedPrefill
from .runner import PhaseRunner, RoundRows, batch_buckets
from .sequence import Sequence, Streamer, round_slots
from .switching import TreeSwitching
from .warm_up import WarmUp

__all__ = ["Engine", "Sequence", "owner_of"]  # (Sequence: what callers add, imported from here too)


def owner_of(proposer) -> Optional["Engine"]:
    """The live engine whose state ``proposer`` holds (the last to begin it), or None."""
    ref = getattr(proposer, "engine", None)
    return None if ref is None else ref()


def _release_if_orphaned(proposer_ref: weakref.ref) -> None:
    """An engine is gone: its proposer, if still alive and unless another engine has taken it
    since, forgets the state sized for it (the KV cache it referenced, its buffers)."""
    proposer = proposer_ref()
    if proposer is not None and owner_of(proposer) is None:
        proposer.release()


class Engine(Admission, TreeSwitching, WarmUp):
    """Decoding state of up to ``max_batch`` sequences of at most ``max_len`` tokens (prompt +
    new tokens + tree), each with its own sampling settings: every sequence's ``temperature`` /
    ``top_k`` / ``top_p``, set as it joins into ``config`` (a
    :class:`~longspec.spec.sampling.RowSampling` of ``max_batch`` rows, made if not given).
    ``cuda_graphs`` (default: on CUDA when the proposer allows it) captures each phase of a round
    on first use. ``bucket_trees``: {batch bucket: tree} for buckets that draft a smaller tree
    than ``tree`` (no deeper, no more nodes; e.g. less speculation where many rows share a
    round), or None (or "plain") for buckets that decode plainly, drafting nothing (where
    speculation does not pay); the others draft ``tree``.
    ``prefill_chunk``: prompts are prefilled in fixed-shape chunks of that many tokens (a prompt's
    rest in the smaller chunks of its ladder; or the ladder's sizes), graph-captured per row and
    size on CUDA (:class:`~longspec.engine.prefill.ChunkedPrefill`; default: one eager prefill).

    The target's KV cache is a :class:`~longspec.kv.cache.BlockPool` of ``block_size``-token blocks
    (default 256, or the row's length rounded up to 64 when shorter) shared by the rows: a
    sequence takes the blocks it can use (prompt, ``max_new_tokens``, one round's tree) when it
    joins and returns them when it leaves. ``pool_tokens``: the pool's size (default: ``max_len``
    for every row, so every request that fits a row is admitted, or on CUDA at most half the free
    device memory); a smaller pool admits a request
    only while it has the blocks (:class:`~longspec.kv.cache.PoolExhausted` otherwise, see
    :meth:`~longspec.engine.blocks.BlockManager.can_admit`). A row reaches ``max_len`` slots
    (rounded up to the block size) through its block table whatever the pool, so every round's
    shapes depend on the batch bucket, the tree and the kind of round only: its CUDA graphs serve
    every later request.

    ``prefix_cache``: full blocks of the prompts (and of finished requests' text) stay indexed by
    content (:class:`~longspec.kv.prefix_cache.PrefixCache`): a prompt that starts with cached blocks
    reuses them and prefills only the rest, with the same output; idle cached blocks are evicted,
    least recently used first, when a request needs blocks. Rows are then always paged (read
    through their block tables). Off for models with dynamic NTK RoPE (a prefix's K/V depend on
    the prompt's length there). Its blocks default to 64 tokens: a hit reuses all but at most 63
    tokens of a shared prefix (the Triton kernels read the table once per 64 keys whatever the
    block size).

    ``compile_proposals``: with compiled steps (``target.compile_steps``), the proposer's draft
    of a round is compiled too, one frame per batch bucket: a round about a third faster, a
    warm-up twice as long (docs/benchmarks.md, "The measurements behind the code's choices").
    ``Generator`` engines compile theirs too (once per machine: on-disk caches); ``longspec
    generate`` runs uncompiled unless ``--compile``."""

    def __init__(self, target: TargetModel, proposer=None, tree: Optional[TreeSpec] = None, max_batch: int = 1,
                 max_len: int = 2048, config: Optional[RowSampling] = None, cuda_graphs: Optional[bool] = None,
                 buckets: Optional[Seq[int]] = None, bucket_trees: Optional[dict] = None,
                 prefill_chunk: Optional[int] = None, pool_tokens: Optional[int] = None,
                 block_size: Optional[int] = None, prefix_cache: bool = False, compile_proposals: bool = False):
        self.target, self.proposer, self.tree = target, proposer, tree
        if config is not None and not isinstance(config, RowSampling):
            raise TypeError(f"an Engine samples per row: config must be a RowSampling (or None), not "
                            f"{type(config).__name__}; each Sequence carries its temperature, top_k and top_p")
        self.config = config if config is not None else RowSampling.zeros(max_batch, target.device)
        device = target.device
        block = block_size or (PREFIX_BLOCK_SIZE if prefix_cache else min(DEFAULT_BLOCK_SIZE, -(-max_len // 64) * 64))
        if block < 1 or max_len < 1 or (pool_tokens is not None and pool_tokens < 1):
            raise ValueError(f"an engine needs max_len, block_size and pool_tokens >= 1, got {max_len}, {block_size}, "
                             f"{pool_tokens}")
        key_block = triton_kernels.DEFAULT_CONFIG.block_n
        if block % key_block and target.attention_impl == "triton":
            raise ValueError(f"block_size {block} with the Triton attention: it must be a multiple of {key_block} (the "
                             "kernels' key block), or the kernels would gather every row's keys at every step")
        self.max_len = -(-max_len // block) * block  # whole blocks (multiples of 64: aligned key masks)
        if proposer is not None and self.max_len < tree.num_nodes:
            raise ValueError(f"max_len {max_len} is smaller than the tree ({tree.num_nodes} nodes)")
        if proposer is not None and not proposer.narrowable:
            buckets = [max_batch]  # a proposer that cannot run on part of the batch: one bucket
        self.buckets = batch_buckets(max_batch, buckets)
        if self.buckets[0] < 1 or self.buckets[-1] > max_batch:
            raise ValueError(f"batch buckets must lie in 1..{max_batch}, got {buckets}")
        self.bucket_trees = {b: None if t in (None, "plain") else TreeSpec.coerce(t)
                             for b, t in (bucket_trees or {}).items()}
        if self.bucket_trees and proposer is None:
            raise ValueError("bucket_trees need a proposer")
        if None in self.bucket_trees.values() and not proposer.follows_plain_rounds:
            raise ValueError(f"{type(proposer).__name__} cannot follow plain rounds: no bucket can decode plainly")
        if set(self.bucket_trees) - set(self.buckets):
            raise ValueError(f"bucket_trees name batch sizes that are not buckets ({self.buckets}): "
                             f"{sorted(set(self.bucket_trees) - set(self.buckets))}")
        num_blocks = pool_blocks(target.cache_config, target.dtype, device, max_batch, self.max_len, block, pool_tokens,
                                 tp=None if target.shard is None else target.shard.tp)
        self.pool = BlockPool(target.cache_config, num_blocks, block, target.dtype, device)
        prefix_cache = prefix_cache and target.config.rope.rope_type != "dynamic"
        self.prefix = PrefixCache(self.pool) if prefix_cache else None
        self.cache = target.new_cache(max_batch, self.max_len, pool=self.pool, paged=prefix_cache,
                                      allocator=self.prefix)
        self.blocks = BlockManager(self.cache, self.prefix, round_slots(tree if proposer is not None else None))
        # keys a step attends over: the whole capacity on CUDA (fixed shapes, capturable); on a CPU
        # the slots in use (reading the longest length costs nothing there)
        self.step_keys = self.max_len if device.type == "cuda" else None
        self.rows: list = [None] * max_batch
        gen = None if self.config.seed is None else torch.Generator(device=device).manual_seed(self.config.seed)
        self.uniforms = Uniforms(gen, device)
        width = 1 if proposer is None else tree.depth + 1
        self.root = torch.zeros(max_batch, dtype=torch.long, device=device)  # next input token per row
        self.active = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.out_tokens = torch.zeros(max_batch, width, dtype=torch.long, device=device)
        self.out_counts = torch.ones(max_batch, dtype=torch.long, device=device)
        if proposer is not None:
            proposer.begin(target, self.cache, tree, self.config, self.uniforms)
            for small in filter(None, self.bucket_trees.values()):
                proposer.with_tree(small)  # raises now for a tree that does not fit or suit the proposer
            proposer.engine = weakref.ref(self)  # its state now belongs to this engine (no cycle through it)
            # a proposer kept by the caller frees it too (held weakly: the proposer holds the target,
            # which holds its engines)
            weakref.finalize(self, _release_if_orphaned, weakref.ref(proposer))
        # with target.compile_steps, the glue around the target's (compiled) layers is compiled too
        self._compiled = target.compile_steps and (proposer is None or proposer.graphable)
        self._accept = compile_step(self._accept_round) if self._compiled else self._accept_round
        self._compile_proposals = self._compiled and compile_proposals
        self.cuda_graphs = proposer is None or proposer.graphable if cuda_graphs is None else cuda_graphs
        self._views: dict = {}
        self.chunked_prefill = (ChunkedPrefill(target, self.cache, prefill_chunk, self.step_keys, self.cuda_graphs)
                                if prefill_chunk else None)
        # one runner (and set of graphs) per kind of round (greedy; sampled; sampled with top-k / top-p) and bucket;
        # ``parked``: {(bucket, tree): (its view, its runners)} of trees :meth:`use_tree` replaced,
        # taken back when that tree returns (their times still count)
        self.runners: dict = {}
        self.parked: dict = {}
        self.fitting: set = set()  # trees :meth:`use_tree` found the proposer drafts (checked once)
        # the proposer is behind the rows' text: :meth:`use_tree` switched to rounds that do not
        # keep it up (plain rounds, which then cost what a plain engine's do; or rounds that use
        # part of it, see Proposer.keeps_up); it catches up when the next tree takes over
        self.behind = False
        self.greedy_round = self.config.greedy
        self.rounds = 0
        # rounds launch() started and finish() has not taken, oldest first: (view, runner, the rows' sequences,
        # the round's tokens and counts [n, width + 1] on their way to the host, the event of their arrival,
        # whether it drafted nothing)
        self._in_flight: deque = deque()
        self.decoded = False  # the round finish() took last drafted nothing: a tree's round was a decode step
        self.warming: Optional[str] = None  # what :meth:`warm_up` prepares now (a status line reads it)
        self.warm_up_seconds: dict = {}  # the last warm-up's seconds per part
        self.warm_up_graphs: dict = {}  # and its compiled graphs per part (see compile_counts)

    # ---- the round --------------------------------------------------------------------------
    def _next_token(self, logits: torch.Tensor, greedy: bool, rows: slice = slice(None)) -> torch.Tensor:
        """logits [n, V] of batch rows ``rows`` -> their next tokens [n] (``greedy``: every row is)."""
        if greedy:
            return logits.argmax(-1)
        return sample(warp_with(self.config, logits, rows), self.uniforms)

    def view(self, n: int) -> "RoundRows":
        """The round's state over batch rows ``0..n-1`` (a bucket): views of the engine's storage."""
        if n not in self._views:
            full = n == len(self.rows)
            cache = self.cache if full else self.cache.rows(0, n)
            proposer, tree = None, self.tree_of(n)
            if self.proposer is not None:
                proposer = self.proposer if full else self.proposer.rows(n, cache)
                if tree is not None and tree is not self.tree:
                    proposer = proposer.with_tree(tree)
            propose = None if tree is None else (compile_step(proposer.propose) if self._compile_proposals
                                                 else proposer.propose)
            width = 1 if tree is None else tree.depth + 1
            self._views[n] = RoundRows(n, cache, self.root[:n], self.active[:n], self.out_tokens[:n, :width],
                                       self.out_counts[:n], proposer, propose, tree,
                                       follows=proposer is not None and not (tree is None and self.behind))
        return self._views[n]

    def tree_of(self, n: int) -> Optional[TreeSpec]:
        """The tree rounds over bucket ``n`` draft (None: they decode plainly, or no proposer)."""
        return self.bucket_trees.get(n, self.tree)

    def _follow_phase(self, v: "RoundRows") -> None:
        v.proposer.decoded(v.root)  # a plain round of a speculative engine: the proposer keeps up

    def _decode_phase(self, v: "RoundRows") -> None:
        logits = self.target.decode(v.root, v.cache, n_keys=self.step_keys, advance=v.active)
        v.root.copy_(self._next_token(logits, self.greedy_round, slice(0, v.n)))
        v.out_tokens[:, 0] = v.root
        if v.proposer is not None:  # (a speculative round's counts share the buffer)
            v.out_counts.fill_(1)
        if v.follows:
            v.proposer.accepted(v.out_tokens, v.out_counts)

    def _propose_phase(self, v: "RoundRows") -> None:
        v.draft_tree = v.propose(v.root)

    def _verify_phase(self, v: "RoundRows") -> None:
        tree, cache = v.draft_tree, v.cache
        positions = cache.lengths[:, None] + tree.depths
        logits = self.target.verify(tree.tokens, positions, tree.mask, cache, n_keys=self.step_keys)
        self._accept(v, tree, logits)

    def _accept_round(self, v: "RoundRows", tree, logits: torch.Tensor) -> None:
        """Verifies the tree against the target's logits [n, N, V], commits the accepted K/V and
        sets the round's outputs and the next roots."""
        if self.greedy_round:
            result = verify_greedy(tree, logits)
        else:
            result = verify_sampling(tree, warp_with(config_rows(self.config, v.n), logits), self.uniforms)
        v.cache.commit(result.accepted_nodes.clamp(min=0), (result.num_accepted + 1) * v.active)
        emitted, counts = result.emitted()
        v.proposer.accepted(emitted, counts)
        v.out_tokens[:, :emitted.shape[1]].copy_(emitted)  # (a lookup chain that drafted nothing: one column)
        v.out_counts.copy_(counts)
        v.root.copy_(result.bonus_token)

    @property
    def round_kind(self) -> tuple:
        """(greedy, truncating) of the current round: every row greedy; or sampled, with top-k /
        top-p on for some row (their sorts) or for none. Each kind has its own captured graphs."""
        truncating = not self.greedy_round and self.config.truncating
        return self.greedy_round, truncating

    def round_kind_of(self, seqs: list) -> tuple:
        """(greedy, truncating): the kind of round these sequences run together (see
        :attr:`round_kind`)."""
        return self._all_greedy(seqs), any(s.temperature > 0 and truncates(s.top_k, s.top_p) for s in seqs)

    def _set_round_kind(self, seqs: list) -> None:
        """The kind of round for these sequences (see :attr:`round_kind`)."""
        self._use_round_kind(*self.round_kind_of(seqs))

    def runner(self, n: int) -> PhaseRunner:
        """The runner of the current kind of round over bucket ``n`` (created, and its graphs
        captured, on first use)."""
        key = (*self.round_kind, n)
        if key not in self.runners:
            v = self.view(n)
            state = [v.root, v.cache.lengths, v.out_tokens, v.out_counts]
            if self.proposer is None:
                phases = [partial(self._decode_phase, v)]
            elif v.tree is None:  # a plain bucket: the proposer takes the round's root in, if it needs to
                phases = [partial(self._decode_phase, v)]
                if v.follows and type(v.proposer).decoded is not Proposer.decoded:
                    phases.insert(0, partial(self._follow_phase, v))
                state += v.proposer.state_tensors() if v.follows else []
            else:
                phases = [partial(self._propose_phase, v), partial(self._verify_phase, v)]
                state += v.proposer.state_tensors()
            self.runners[key] = PhaseRunner(phases, state, self.uniforms, self.target.device, self.cuda_graphs,
                                            reset=v.cache.discard)
        return self.runners[key]

    def close(self) -> None:
        """Drops the captured graphs, the references the engine holds to itself (its runners'
        phases, its compiled accept step) and its proposer's state, so that releasing the engine
        frees its caches at once rather than at the next garbage collection (or, through a
        proposer kept for the next engine, only once that one has allocated its own). The engine
        cannot run afterwards."""
        self.runners.clear()
        self.parked.clear()
        self._views.clear()
        self.chunked_prefill = None
        self._accept = None
        if self.proposer is not None and owner_of(self.proposer) is self:  # its state belongs to this engine
            self.proposer.release()

    def _round(self, n: int) -> tuple:
        """(view, runner) of bucket ``n`` for the current kind of round, the proposer told which
        kind it drafts for (captured graphs keep what it was told at capture)."""
        v = self.view(n)
        if v.tree is not None and hasattr(v.proposer, "sample_children"):
            v.proposer.sample_children = not self.greedy_round and v.tree.is_static
        return v, self.runner(n)

    def bucket_for(self, n: int) -> int:
        """The smallest bucket of at least ``n`` rows."""
        return next((b for b in self.buckets if b >= n), self.buckets[-1])

    def bucket(self) -> int:
        """The smallest bucket that holds every active row."""
        top = 1 + max(s.row for s in self.rows if s is not None)
        return next(b for b in self.buckets if b >= top)

    @torch.inference_mode()
    def step(self, streamer: Optional[Streamer] = None) -> None:
        """Advances every active sequence by one round; finished ones leave the batch. The round
        computes only the rows of the smallest bucket holding every active sequence; a round in
        which every row decodes greedily skips the sampling work, one in which no sampled row uses
        top-k or top-p skips their sorts (each kind its own captured graphs). :meth:`launch`
        then :meth:`finish`."""
        if self.has_active:
            self.launch()
            self.finish(streamer)

    @property
    def in_flight(self) -> int:
        """Rounds launched and not finished yet."""
        return len(self._in_flight)

    def can_launch_ahead(self) -> bool:
        """Whether a round may start before the rounds in flight are finished: every row still
        needs tokens after they emit their most. Its writes then stay inside the blocks each row
        holds (``BlockManager.need``); a row that meets its EOS meanwhile only wastes it (its part is
        dropped)."""
        most = sum(v.out_tokens.shape[1] for v, *_ in self._in_flight)
        return self.has_active and all(len(s.tokens) + most < s.max_new_tokens for s in self.rows if s is not None)

    @torch.inference_mode()
    def launch(self, ahead: bool = False) -> None:
        """Starts a round (see :meth:`step`; there must be active sequences) and returns before the
        device has run it: the host may work meanwhile, on anything but this engine's state,
        until :meth:`finish`. ``ahead``: while the rounds launched before still run (where
        :meth:`can_launch_ahead`): the device goes from one to the next without waiting for the
        host to read their tokens. Its inputs are the last round's outputs, on the device."""
        if self._in_flight and not (ahead and self.can_launch_ahead()):
            raise RuntimeError("a round is running: finish() it first (or launch ahead, where a row has room)")
        seqs = [s for s in self.rows if s is not None]
        self._set_round_kind(seqs)
        v, runner = self._round(self.bucket())
        runner.run_round()
        self.rounds += 1
        out, arrived = torch.cat([v.out_tokens, v.out_counts[:, None]], 1), None
        if out.is_cuda:  # (to pinned memory, in stream order: the next round may overwrite the outputs)
            out, arrived = out.to("cpu", non_blocking=True), torch.cuda.Event()
            arrived.record()
        # (eagerly, a lookup chain with no match drafts the root alone: PromptLookup.decode_below)
        decoded = v.tree is not None and not runner.graphs and v.draft_tree.num_nodes == 1 < v.tree.num_nodes
        self._in_flight.append((v, runner, seqs, out, arrived, decoded))

    @torch.inference_mode()
    def finish(self, streamer: Optional[Streamer] = None) -> Optional[float]:
        """Waits for the oldest round :meth:`launch` started and takes its tokens: emitted (to
        ``streamer``), finished sequences leave the batch (rows that left since it was launched
        drop theirs). Returns its tokens per row (None: no row took any)."""
        if not self._in_flight:
            raise RuntimeError("no round is running: launch() one first")
        v, runner, seqs, out, arrived, self.decoded = self._in_flight.popleft()
        if arrived is not None:
            arrived.synchronize()
        out = out.tolist()  # (on a CPU: the round's one sync)
        runner.collect_times()
        tokens = rows = 0
        for s in seqs:
            if self.rows[s.row] is not s:
                continue
            row = out[s.row]
            n = row[-1]
            tokens, rows = tokens + n, rows + 1
            if self.proposer is not None:
                hist = s.accepted_hist
                hist.extend([0] * (n - len(hist)))
                hist[n - 1] += 1
            self._emit(s, row[:n], streamer)
            if s.done:
                self._release(s)
        return tokens / rows if rows else None

