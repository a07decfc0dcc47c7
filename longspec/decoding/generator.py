"""The public generation API: :class:`Generator`, a thin front over a long-lived
:class:`~longspec.engine.engine.Engine`.

One engine per (target, proposer, tree, context) lives as long as its target, shared by every
``Generator`` of that target: its KV block pool, its proposer's state and its captured CUDA
graphs serve every later call whatever the prompt's length, ``max_new_tokens`` or sampling
settings (those are per-row tensors), so only a process's first call of each kind of round pays
compilation and capture: greedy, sampled, sampled with top-k / top-p (its rounds sort the
vocabulary: a kind of their own, which other sampled calls do not pay for)."""
from __future__ import annotations

import gc
import time
from dataclasses import replace
from typing import Optional

import numpy as np
import torch

from ..config import GenerationConfig
from ..engine.engine import Engine, owner_of
from ..engine.scheduler import Scheduler
from ..engine.sequence import GenerationOutput, Prompts, Sequence, Streamer, cache_need, round_slots
from ..kv.cache import kv_pool_tokens
from ..models.target import TargetModel
from ..spec.proposers import PROPOSERS, default_tree, proposer_family
from ..spec.sampling import RowSampling
from ..spec.tree import TreeSpec
from .auto import Plan, candidate_trees, costs_measured, resolve
from .rounds import run_rounds, tree_text
from .shared import Engines, new_controller
from .step_costs import device_key

# on CUDA a prompt is prefilled in captured chunks of this many tokens (ChunkedPrefill; its rest in
# 256- and 64-token chunks): the size that prefilled 2k-8k-token prompts fastest (docs/benchmarks.md,
# "A user's workload on the GPU")
PREFILL_CHUNK = 2048
DEFAULT_KV_ROWS = 8  # a Generator's KV pool on CUDA: rows of max_len (so a few long documents stay cached)



class _Clock:
    """Wall-clock timer that waits for the device first, so GPU time is counted."""

    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


class Generator:
    """Generates with a target model, autoregressively or speculatively.

    ``proposer``: None or "none" (plain decoding), a name ("pld", "streaming", "longspec",
    "hybrid", or "auto": plain rounds, prompt lookup's chains or the hybrid's trees, chosen while
    generating by measured tokens per second, starting from a cost model, as ``longspec
    generate`` does), or a :class:`~longspec.spec.proposers.Proposer`.
    ``draft``: the LongSpec draft of "longspec" / "hybrid" / "auto" (loaded, or a checkpoint
    folder; default: the one shipped for the default model). ``tree``: the tree to draft (a
    :class:`TreeSpec` or its string form; default per proposer, see :func:`default_tree`).
    ``window``: the recent window of "streaming".

    ``max_len`` caps a row of the KV cache (prompt + new tokens + tree); it defaults to the
    target's ``max_position_embeddings``. ``cuda_graphs``: see :class:`Engine`. ``controller``:
    switches trees while generating (``begin(None, None)`` gives the first rounds' tree, then
    ``observe(tokens, seconds, tree)`` after each round the next; ``end()``; see
    :class:`~longspec.decoding.controller.Controller`); ``tree`` is then the biggest it may pick.
    ``prefix_cache``: a call whose prompts
    start with a prefix of an earlier call's prompt or text (same document, next chat turn)
    reuses its K/V and prefills only the rest, with the same output (``stats["cached_tokens"]``).
    ``kv_memory``: the KV pool's size, which the prefix cache keeps earlier documents in: GiB
    ("8", "8GiB") or a fraction of the memory free ("0.3", "30%"), as ``longspec serve
    --kv-memory`` (default: on CUDA :data:`DEFAULT_KV_ROWS` rows of ``max_len`` within a quarter
    of the free memory; on a CPU a row per batch row; never fewer; ``stats["kv_pool_tokens"]``).

    Calls run on a long-lived engine shared by every Generator of the target with the same
    proposer, tree and ``max_len`` (see the module docstring): after the first call of each kind
    (greedy, sampled, sampled with top-k / top-p), new prompt lengths, ``max_new_tokens`` and
    sampling settings capture and compile nothing."""

    def __init__(self, target: TargetModel, proposer=None, tree=None, max_len: Optional[int] = None,
                 cuda_graphs: Optional[bool] = None, controller=None, draft=None, window: int = 512,
                 prefix_cache: bool = True, kv_memory=None):
        if proposer is None or proposer == "none":
            proposer = None
            if tree is not None:
                raise ValueError("a tree shape needs a proposer (Generator(target, proposer=..., tree=...))")
        elif isinstance(proposer, str):
            if proposer not in PROPOSERS:
                raise ValueError(f"unknown proposer {proposer!r}; expected one of {', '.join(PROPOSERS)}")
            draft = Engines.of(target).draft(draft) if proposer in ("auto", "longspec", "hybrid") else draft
            if proposer == "auto":
                if tree is not None:
                    raise ValueError("proposer 'auto' chooses its tree itself: leave tree out")
            else:  # one proposer per name and draft in the process: Generators of it share its engine
                proposer = Engines.of(target).proposer(proposer, draft, window)
        if proposer is not None and proposer != "auto":
            tree = TreeSpec.coerce(default_tree(proposer_family(proposer), target.device.type) if tree is None
                                   else tree)
            tree.validate(target.config.vocab_size)
        self.target, self.proposer, self.tree, self.controller, self.draft = target, proposer, tree, controller, draft
        self.max_len = max_len or target.config.max_position_embeddings
        self.cuda_graphs, self.prefix_cache = cuda_graphs, prefix_cache
        self.kv_memory = kv_memory
        if kv_memory is not None:
            kv_pool_tokens(target.cache_config, target.dtype, target.device, self.max_len, kv_memory)  # (said now)
        self._key = None  # the key of the last call's engine

    @property
    def _engine(self) -> Optional[Engine]:
        """The engine of the last call (held by the target's :class:`Engines` only, so a replaced
        engine is freed whatever Generator used it)."""
        return Engines.of(self.target).get(self._key)

    def _prepare(self, prompts: Prompts, config: GenerationConfig):
        if isinstance(prompts, (str, bytes)) or (len(prompts) > 0 and isinstance(prompts[0], (str, bytes))):
            raise TypeError("Generator.generate takes token ids (a list of ints, or a list of such lists), not text: "
                            "tokenize first, e.g. AutoTokenizer.from_pretrained(target.path)(text).input_ids")
        if len(prompts) == 0:
            raise ValueError("no prompts given")
        if isinstance(prompts[0], int) or (torch.is_tensor(prompts) and prompts.dim() == 1):
            prompts = [prompts]
        prompts = [list(map(int, p)) for p in prompts]
        vocab = self.target.config.vocab_size
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            try:  # (numpy: a Python loop over a long prompt takes milliseconds)
                ids = np.asarray(p, dtype=np.int64)
                bad = ids[(ids < 0) | (ids >= vocab)].tolist()
            except OverflowError:  # (beyond int64)
                bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary (size {vocab})")
        return prompts

    # whether a round is launched before the last one's tokens are read (None: where rounds run
    # asynchronously to the host, on a GPU; see run_rounds)
    launch_ahead: Optional[bool] = None
    _outlined: Optional[tuple] = None  # ((draft, device key), auto's trees) once its costs are measured

    @staticmethod
    def _need(prompts: list, config: GenerationConfig, tree: Optional[TreeSpec]) -> int:
        """Positions the longest prompt needs with ``max_new_tokens`` and one round of ``tree``."""
        return cache_need(max(map(len, prompts)), config.max_new_tokens, round_slots(tree))

    def _check_room(self, prompts: list, config: GenerationConfig, tree: Optional[TreeSpec]) -> None:
        longest, need = max(map(len, prompts)), self._need(prompts, config, tree)
        if need > self.max_len:
            about = f" and {round_slots(tree)} tree slots" if tree is not None else ""
            raise ValueError(
                f"prompt of {longest} tokens with max_new_tokens {config.max_new_tokens}{about} needs {need} "
                f"positions, over the maximum length {self.max_len} (the model's context; shorten the prompt, "
                "lower max_new_tokens, use a smaller tree, or pass Generator(max_len=...))")

    def plan(self, prompts: list, config: GenerationConfig) -> Plan:
        """What a call on ``prompts`` runs: this Generator's proposer and tree, or for "auto" the
        candidates of the cost model on the first prompt (:func:`~longspec.decoding.auto.resolve`),
        which a controller chooses among while it generates."""
        if self.proposer != "auto":
            return Plan("", self.tree, self.tree, proposer=self.proposer, controller=self.controller)

        chosen = resolve(self.target, prompts[0], self.draft)
        proposer = Engines.of(self.target).proposer(chosen.name, self.draft)
        return replace(chosen, proposer=proposer, choices=tuple(chosen.predicted or ()))

    def _outline(self) -> Optional[Plan]:
        """For "auto" where its plan can be made while the device prefills (its step costs
        measured: making it is then the host's work alone; a draft with an acceptance table, or
        none): the proposer and the biggest tree of every prompt's plan (the engine), with every
        tree it may choose; else None (the plan is made first)."""
        if self.proposer != "auto" or (self.draft is not None and not self.draft.config.acceptance):
            return None
        key = self.draft, device_key(self.target)  # (threads, attention, dtype: the costs' key)
        if self._outlined is None or self._outlined[0] != key:  # (once: the costs stay measured)
            if not costs_measured(self.target, self.draft):
                return None
            self._outlined = key, candidate_trees(self.draft, self.target.device.type == "cuda")
        trees, name = self._outlined[1], "pld" if self.draft is None else "hybrid"
        return Plan(name, trees[0], None, proposer=Engines.of(self.target).proposer(name, self.draft),
                    choices=(*trees, None))

    def _begin(self, engine: Engine, plan: Plan, config: GenerationConfig) -> tuple:
        """(controller, auto's predictions or None, the tree of the first rounds) of a call of
        ``plan``: auto's controller of ``engine`` begun with its predictions, or the one given to
        this Generator, or none."""
        if plan.predicted is not None:
            controller = Engines.of(self.target).controller(engine, self.draft)
            return controller, plan.predicted, controller.begin(plan.predicted, sampling_key(config))
        if plan.controller is not None:
            return plan.controller, None, plan.controller.begin(None, None)
        return None, None, plan.start

    def first_rounds(self, plan: Plan, config: GenerationConfig) -> tuple:
        """(tree, predicted speed over plain decoding) of the first rounds of a call of ``plan``
        (from :meth:`plan`) in a new process: for "auto" the candidate its controller predicts
        fastest (from the cost model's predictions corrected by what earlier processes measured;
        it times plain rounds first); else ``plan.start``."""
        if plan.predicted is None:
            return plan.start, None
        controller = new_controller(self.target, self.draft)
        controller.begin(plan.predicted, sampling_key(config))
        return controller.planned.tree, controller.gain()

    def engine(self, proposer, tree: Optional[TreeSpec], batch: int) -> Engine:
        """The process-wide engine of this target for ``proposer`` drafting trees up to ``tree``,
        with at least ``batch`` rows (built on first use, or rebuilt with more rows)."""
        engines = Engines.of(self.target)
        # (the attention, compilation, dtype and device settings are the engine's too: its steps use them)
        key = (None if proposer is None else id(proposer), str(tree), self.max_len, self.cuda_graphs,
               self.prefix_cache, None if self.kv_memory is None else str(self.kv_memory),
               self.target.attention_impl, self.target.compile_steps, str(self.target.dtype), str(self.target.device))
        engine = engines.get(key)
        if engine is not None and (len(engine.rows) < batch or (proposer is not None and owner_of(proposer) is not engine)):
            batch = max(batch, len(engine.rows))
            engine = None
        if engine is None:
            engines.replace(key, proposer)
            chunk = min(PREFILL_CHUNK, self.max_len) if self.target.device.type == "cuda" else None
            # (with compiled steps the proposals are compiled too, once per machine: on-disk caches)
            engine = Engine(self.target, proposer, tree, batch, self.max_len, RowSampling.zeros(batch, self.target.device),
                            self.cuda_graphs, prefill_chunk=chunk, prefix_cache=self.prefix_cache,
                            compile_proposals=True,
                            pool_tokens=kv_pool_tokens(self.target.cache_config, self.target.dtype, self.target.device,
                                                       self.max_len, self.kv_memory, batch, DEFAULT_KV_ROWS))
            engines.engines[key] = engine
        self._key = key
        return engine

    @torch.inference_mode()
    def generate(self, prompts: Prompts, config: Optional[GenerationConfig] = None,
                 streamer: Optional[Streamer] = None, plan: Optional[Plan] = None) -> GenerationOutput:
        """Generates up to ``config.max_new_tokens`` tokens after each prompt (a list of token ids
        or a list of such lists; rows may differ in length). A row stops at its first EOS token,
        which is included in its output. ``streamer(row, tokens)`` is called as tokens appear.

        With a proposer, each round drafts a tree, verifies it in one target forward and commits
        the accepted tokens' K/V; the output is the target's own (greedy: token for token;
        sampling: the same distribution). Finished rows leave the batch. ``plan``: what
        :meth:`plan` returned for these prompts, if the caller has it already."""
        config = config or GenerationConfig()
        prompts = self._prepare(prompts, config)
        # before anything slow (auto's plan): what plain decoding needs, or this Generator's tree
        self._check_room(prompts, config, None if self.proposer == "auto" else self.tree)
        clock = _Clock(self.target.device)
        t_plan = time.perf_counter()
        outline = self._outline() if plan is None else None
        plan = plan or outline or self.plan(prompts, config)
        near_end = self.proposer == "auto" and self._need(prompts, config, plan.tree) > self.max_len
        if near_end:
            # near the context's end (plain decoding fits: checked above): plain rounds in auto's
            # engine (its graphs captured, no second KV pool), its rows holding room for them only
            plan, outline = Plan("none", plan.tree, None, note="the prompt leaves no room for a speculative tree",
                                 proposer=plan.proposer), None
        t_setup = time.perf_counter()
        plan_s = t_setup - t_plan
        engine = self.engine(plan.proposer, plan.tree, len(prompts))
        captures_before = collected_at = engine.capture_seconds()
        if engine.cuda_graphs:  # the prefill chunk steps (one per size, serving every row): later calls capture none
            engine.prepare_prefill()
        eos = frozenset(config.eos_ids(self.target.config))
        seqs = [Sequence(p, config.max_new_tokens, eos, temperature=config.temperature, top_k=config.top_k or 0,
                         top_p=config.top_p or 1.0, plain_rounds=near_end) for p in prompts]
        kind = engine.round_kind_of(seqs)
        captured = Engines.of(self.target).controller(engine, self.draft).captured_kinds if plan.choices else None
        if plan.choices and engine.cuda_graphs and kind not in captured:
            # every round auto may switch to, captured for this kind of round now: later calls of
            # this kind capture nothing
            trees = sorted(plan.choices, key=lambda t: (t is None, -(t.num_nodes if t else 0)))
            engine.warm_up(trees=trees, prefill_by_layer=False, kinds=[kind])  # (only a long prompt needs that)
            captured.add(kind)
            collected_at = engine.capture_seconds()  # (the warm-up ends with a full collection)
        made = []  # (the plan, made while the device prefills, its seconds; the controller, predictions, start)

        def make_plan() -> None:
            # the plan, the controller's first choice and its tree, before the proposer takes the
            # rows in for that tree (at the prefill: their first round waits for nothing)
            t = time.perf_counter()
            made.extend((self.plan(prompts, config), time.perf_counter() - t))
            if (made[0].proposer, made[0].tree) != (outline.proposer, outline.tree):
                raise RuntimeError(f"auto's plan ({made[0].name}, {made[0].tree}) left the engine it was "
                                   f"outlined for ({outline.name}, {outline.tree})")
            made.extend(self._begin(engine, made[0], config))
            if engine.tree_of(engine.bucket_for(len(prompts))) != made[-1]:
                engine.use_tree(made[-1])

        controller = predicted = None
        if outline is None:
            controller, predicted, start = self._begin(engine, plan, config)
        else:
            start = None  # (the plan's first tree is chosen during the prefill: make_plan)
        if outline is None and plan.proposer is not None and engine.tree_of(engine.bucket_for(len(prompts))) != start:
            engine.use_tree(start)
        engine.uniforms.generator = (None if config.seed is None else
                                     torch.Generator(device=self.target.device).manual_seed(config.seed))
        times_before = engine.phase_times()
        t0 = clock()
        setup_s = t0 - t_setup
        try:
            scheduler = Scheduler(engine)
            scheduler.submit(seqs)
            admitted = scheduler.schedule()  # (all: the engine has a row, and a row's blocks, for each prompt)
            if len(admitted) < len(seqs):
                raise RuntimeError(f"{len(seqs) - len(admitted)} of {len(seqs)} prompts found no room in an engine "
                                   f"sized for them")
            engine.add(admitted, streamer, meanwhile=make_plan if outline is not None else None)
            if outline is not None:
                plan, plan_s, controller, predicted, start = made
            trees = [(0, tree_text(start))] if controller is not None else []
            repredict = plan.repredict if predicted is not None and len(seqs) == 1 else None
            t_prefill = clock()
            rounds, stepping = run_rounds(engine, seqs, streamer, controller, trees, repredict, self.launch_ahead)
        finally:  # a failed or interrupted call leaves the shared engine empty
            for s in seqs:
                engine.cancel(s)
            controller = controller if controller is not None or len(made) < 3 else made[2]  # (begun in make_plan)
            if controller is not None:
                controller.end()
        t_end = clock()
        n_new = sum(len(s.tokens) for s in seqs)
        decoded = n_new - len(seqs)  # the first token of each row comes from the prefill
        stats = dict(prompt_tokens=sum(map(len, prompts)), cached_tokens=sum(s.cached_tokens for s in seqs),
                     new_tokens=n_new, prefill_s=t_prefill - t0,
                     decode_s=t_end - t_prefill, wall_s=t_end - t0, steps=rounds,
                     tokens_per_s=decoded / max(t_end - t_prefill, 1e-9),
                     capture_s=engine.capture_seconds() - captures_before, plan_s=plan_s, setup_s=setup_s,
                     kv_pool_tokens=engine.pool.num_blocks * engine.pool.block_size,
                     rounds_s=stepping, host_s=max(t_end - t_prefill - stepping, 0.0),
                     cuda_graphs=any(r.graphs is not None for r in engine.all_runners))
        if engine.capture_seconds() > collected_at:
            # this call compiled: the many objects that leaves are collected now, in the call
            # that paid seconds for them, and what lives on (the model, the compiled steps and
            # graphs) moves out of the collector's reach (gc.freeze, as `longspec serve` does):
            # a full collection that Python's thresholds start in a later call scans only what
            # is new, not every object the compiled steps hold (gc.unfreeze() undoes it)
            gc.collect()
            gc.freeze()
        if trees:
            stats["trees"] = trees  # (tokens generated, tree from then on: None = plain rounds)
        if plan.note:
            stats["auto"] = plan.note + (f" ({controller.summary()})" if predicted is not None else "")
        if predicted is not None and decoded > 0:  # its decoding against plain rounds' (measured in this engine)
            vs_plain = controller.vs_plain(decoded / (stats["decode_s"] * 1e3))
            if vs_plain is not None:
                stats["vs_plain"] = vs_plain
        phase_s = [a - b for a, b in zip(engine.phase_times(), times_before)]
        if plan.proposer is not None:
            hist = [0] * (plan.tree.depth + 1)
            for s in seqs:
                for n, c in enumerate(s.accepted_hist):
                    hist[n] += c
            n_rounds = sum(hist)
            stats.update(tau=sum((n + 1) * c for n, c in enumerate(hist)) / max(n_rounds, 1), accepted_hist=hist,
                         draft_s=phase_s[0], verify_s=phase_s[-1],
                         other_s=max(t_end - t_prefill - sum(phase_s), 0.0))
        return GenerationOutput([s.tokens for s in seqs], stats)


def sampling_key(config: GenerationConfig) -> tuple:
    """What acceptance depends on in a call's settings: (temperature, top_k, top_p)."""
    return config.temperature, config.top_k or 0, config.top_p or 1.0
