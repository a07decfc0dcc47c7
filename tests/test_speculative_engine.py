"""The speculative ``Engine``: requests joining and leaving between rounds, batch buckets with
trees of their own (and plain buckets), idle rows over many rounds, warm-up, one engine reused
by a generator for every call and released at once when replaced, fresh random numbers after a
captured round, the collector paused around captures."""
import time

import pytest
import torch

from longspec import GenerationConfig
from longspec.decoding.generator import Generator
from longspec.spec.proposers import LongSpecProposer, PromptLookup
from longspec.spec.streaming import StreamingSelfSpec
from longspec.spec.tree import TreeSpec
from conftest import cyclic_garbage  # noqa: E402
from test_speculative import prompts_for


@pytest.mark.parametrize("proposer", ["none", "streaming", "pld", "hybrid"])
def test_sequences_join_and_leave_between_rounds(targets, proposer):
    """Engine.step with requests added while others run, in rows freed by finished ones: each
    output equals the request generated alone. Rounds run over the smallest batch bucket that
    holds the active rows (1, 2 or 3 here), and every bucket is used."""
    from longspec.engine.engine import Engine, Sequence
    from longspec.spec.proposers import LongSpecProposer
    from longspec.models.draft import DraftConfig, init_draft

    target = targets["qwen3"]
    prompts = prompts_for(3, seed=21) + prompts_for(2, seed=22)
    budgets = [5, 14, 9, 12, 7]
    alone = [Generator(target).generate([p], GenerationConfig(max_new_tokens=n, ignore_eos=True)).sequences[0]
             for p, n in zip(prompts, budgets)]
    if proposer == "hybrid":
        draft = LongSpecProposer(init_draft(DraftConfig.for_target(target, window=8), target, seed=2), PromptLookup())
    else:
        draft = {"none": None, "streaming": StreamingSelfSpec(window=8, sinks=2), "pld": PromptLookup()}[proposer]
    engine = Engine(target, draft, None if draft is None else TreeSpec.parse("2,3,3"), max_batch=3, max_len=96)
    assert engine.buckets == [1, 2, 3]
    seqs = [Sequence(p, n) for p, n in zip(prompts, budgets)]
    run_joining(engine, seqs)
    assert [s.tokens for s in seqs] == alone
    assert {key[-1] for key in engine.runners} == {1, 2, 3}


@pytest.mark.parametrize("proposer", ["streaming", "pld", "hybrid"])
def test_buckets_with_trees_of_their_own_equal_alone(targets, proposer):
    """Buckets may draft smaller trees than the engine's (less speculation where many rows share a
    round): requests moving between buckets, and so between trees, still get exactly the tokens
    they get alone; a tree that does not fit, or a bucket that is none, is refused up front."""
    from longspec.engine.engine import Engine, Sequence
    from longspec.spec.proposers import LongSpecProposer
    from longspec.models.draft import DraftConfig, init_draft

    target = targets["qwen3"]
    prompts = prompts_for(3, seed=23) + prompts_for(2, seed=24)
    budgets = [6, 13, 9, 11, 8]
    alone = [Generator(target).generate([p], GenerationConfig(max_new_tokens=n, ignore_eos=True)).sequences[0]
             for p, n in zip(prompts, budgets)]

    def make():
        if proposer == "hybrid":
            draft = init_draft(DraftConfig.for_target(target, window=8), target, seed=2)
            return LongSpecProposer(draft, PromptLookup())
        return {"streaming": StreamingSelfSpec(window=8, sinks=2), "pld": PromptLookup()}[proposer]

    smaller = {2: "2,2", 3: "2"}
    engine = Engine(target, make(), TreeSpec.parse("2,3,3"), max_batch=3, max_len=96, bucket_trees=smaller)
    assert [engine.view(n).tree for n in (1, 2, 3)] == [TreeSpec.parse(t) for t in ("2,3,3", "2,2", "2")]
    seqs = [Sequence(p, n) for p, n in zip(prompts, budgets)]
    run_joining(engine, seqs)
    assert [s.tokens for s in seqs] == alone
    assert {key[-1] for key in engine.runners} == {1, 2, 3}
    assert [engine.view(n).draft_tree.num_nodes for n in (1, 2, 3)] == [9, 5, 3]  # what each bucket drafted
    # a bucket that decodes plainly (where no tree pays): rows moving from and back into drafting
    # buckets keep the proposer's state (draft ring buffer, lookup history) up to date
    engine = Engine(target, make(), TreeSpec.parse("2,3,3"), max_batch=3, max_len=96, bucket_trees={2: "plain"})
    seqs = [Sequence(p, n) for p, n in zip(prompts, budgets)]
    run_joining(engine, seqs)
    assert [s.tokens for s in seqs] == alone
    assert engine.view(2).draft_tree is None and engine.view(3).draft_tree.num_nodes == 9
    # only the draft has state to bring up to date in a plain round: the others run the target alone
    assert len(engine.runners[True, False, 2].phases) == (2 if proposer == "hybrid" else 1)
    assert len(engine.phase_times()) == 2 and all(t >= 0 for t in engine.phase_times())

    class Unaware(PromptLookup):  # a proposer that does not say it can follow plain rounds
        follows_plain_rounds = False

    with pytest.raises(ValueError, match="cannot follow plain rounds"):
        Engine(target, Unaware(), TreeSpec.parse("2,3,3"), max_batch=3, max_len=96, bucket_trees={2: "plain"})
    if proposer == "hybrid":  # plain rounds write the tokens they decode into the draft's window
        alone_plain = Engine(target, make(), TreeSpec.parse("2,3,3"), max_batch=1, max_len=96,
                             bucket_trees={1: "plain"})
        single = Sequence(prompts[0], 6)
        alone_plain.add([single])
        while alone_plain.has_active:
            alone_plain.step()
        proposer_, full = alone_plain.proposer, torch.tensor(prompts[0] + single.tokens)
        ring, last = proposer_.ring, len(prompts[0]) + 4  # the 5 roots fed to the plain rounds end here
        index = torch.arange(last - ring.window + 1, last + 1)
        k, _ = proposer_.draft.window_kv(full[index][None], index[None])
        slots = index % ring.size
        assert torch.equal(ring.slot_index[0, slots], index)
        torch.testing.assert_close(ring.k[0][:, slots], k[0])
    with pytest.raises(ValueError, match="does not fit"):
        Engine(target, make(), TreeSpec.parse("2,3,3"), max_batch=3, max_len=96, bucket_trees={2: "2,2,2,2"})
    with pytest.raises(ValueError, match="not buckets"):
        Engine(target, make(), TreeSpec.parse("2,3,3"), max_batch=4, max_len=96, bucket_trees={3: "2"})
    if proposer == "hybrid":  # (a chain is allowed: the hybrid's lookup then drafts it alone)
        with pytest.raises(ValueError, match="beam trees"):
            Engine(target, make(), TreeSpec.parse("2,3,3"), max_batch=3, max_len=96, bucket_trees={2: "1,2"})


def run_joining(engine, seqs: list) -> None:
    """Runs ``seqs`` on ``engine``: one alone (bucket 1), then two (bucket 2), then the others as
    rows free up."""
    engine.add(seqs[:1])
    engine.step()
    engine.add(seqs[1:2])
    engine.step()
    waiting = seqs[2:]
    while engine.has_active or waiting:
        if waiting and engine.free_rows():
            engine.add([waiting.pop(0)])
        engine.step()


@pytest.mark.parametrize("proposer", ["pld", "streaming"])
def test_idle_rows_survive_many_rounds(targets, proposer):
    """A row that finished early keeps taking part in (masked) rounds while another one runs far
    longer: nothing it holds may outgrow its buffers."""
    from longspec.engine.engine import Engine, Sequence

    target = targets["llama"]
    gen = torch.Generator().manual_seed(4)
    short, long = (torch.randint(0, 160, (n,), generator=gen).tolist() for n in (40, 10))
    draft = PromptLookup() if proposer == "pld" else StreamingSelfSpec(window=8, sinks=2)
    engine = Engine(target, draft, TreeSpec.parse("chain:5"), max_batch=2, max_len=70)
    seqs = [Sequence(short, 2), Sequence(long, 52)]
    engine.add(seqs)
    while engine.has_active:
        engine.step()
    alone = Generator(target).generate([long], GenerationConfig(max_new_tokens=52, ignore_eos=True)).sequences[0]
    assert seqs[1].tokens == alone and engine.rounds > 30


def test_warm_up_prepares_every_bucket_and_changes_nothing(targets):
    """Engine.warm_up on an empty engine creates each bucket's runner; the tokens generated
    afterwards are those of a fresh engine."""
    from longspec.engine.engine import Engine, Sequence

    target = targets["llama"]
    prompt, config = prompts_for(1, seed=5)[0], GenerationConfig(max_new_tokens=9, ignore_eos=True)
    expected = Generator(target, PromptLookup(), "2,2").generate([prompt], config).sequences[0]
    engine = Engine(target, PromptLookup(), TreeSpec.parse("2,2"), max_batch=5, max_len=64)
    engine.warm_up(sampled=True)
    kinds = [(True, False), (False, False), (False, True)]  # greedy, sampled, sampled with top-k / top-p
    assert set(engine.runners) == {(*kind, n) for kind in kinds for n in (1, 2, 4, 5)}
    seq = Sequence(prompt, 9)
    engine.add([seq])
    while engine.has_active:
        engine.step()
    assert seq.tokens == expected
    engine.add([Sequence(prompt, 20)])
    with pytest.raises(RuntimeError, match="empty engine"):
        engine.warm_up()


@pytest.mark.parametrize("proposer", ["none", "pld"])
def test_rounds_sort_for_top_k_or_top_p_only_while_a_sampled_row_uses_them(targets, proposer):
    """Sampled rounds skip top-k / top-p's sorts of the whole vocabulary unless a sampled row uses
    them (a kind of round with graphs of its own): a top-k 1 row still gets the greedy tokens
    beside a row sampled from the whole distribution, and once it has left, rounds go without."""
    from longspec.engine.engine import Engine, Sequence
    from longspec.spec.sampling import RowSampling

    target = targets["llama"]
    prompt = prompts_for(1, seed=3)[0]
    draft, tree = (None, None) if proposer == "none" else (PromptLookup(), TreeSpec.parse("2,2"))
    greedy = Generator(target).generate([prompt], GenerationConfig(max_new_tokens=10, ignore_eos=True)).sequences[0]
    engine = Engine(target, draft, tree, max_batch=2, max_len=96, config=RowSampling.zeros(2, "cpu"))
    engine.uniforms.generator = torch.Generator().manual_seed(0)
    top1, free = Sequence(prompt, 10, temperature=1.5, top_k=1), Sequence(prompt, 40, temperature=1.5)
    engine.add([top1, free])
    kinds = []
    while engine.has_active:
        engine.step()
        kinds.append(engine.round_kind)
    assert top1.tokens == greedy and free.tokens[:10] != greedy
    assert kinds[0] == (False, True) and kinds[-1] == (False, False)
    assert {key[:2] for key in engine.runners} == {(False, True), (False, False)}


def test_warm_up_ends_with_a_full_garbage_collection(targets, automatic_gc_off):
    """What the warm-up (or anything before it) left as garbage is collected by the warm-up, not
    by a full collection in the middle of a later request."""
    from longspec.engine.engine import Engine

    engine = Engine(targets["llama"], PromptLookup(), TreeSpec.parse("2,2"), max_batch=1, max_len=64)
    gone = cyclic_garbage()  # (only the warm-up's own collection can free it)
    assert gone() is not None
    engine.warm_up()
    assert gone() is None


def test_a_generate_call_that_compiled_collects_its_garbage_and_one_that_did_not_leaves_it(targets, monkeypatch,
                                                                                             automatic_gc_off):
    """A ``Generator`` call that prepared (compiled, captured) steps ends with a full collection:
    its leftovers do not make a later call pay for one; a call that prepared nothing does not.
    (On a CPU these steps run eagerly: the preparation's seconds are the engine's, set here.)"""
    from longspec.engine.engine import Engine

    prepared = [0.0]
    monkeypatch.setattr(Engine, "capture_seconds", lambda self: prepared[0])
    gen = Generator(targets["llama"], proposer=PromptLookup(), tree=TreeSpec.parse("2,2"))
    config = GenerationConfig(max_new_tokens=4)
    gone = cyclic_garbage()
    first = gen.generate([[1, 2, 3, 1, 2]], config, streamer=lambda row, tokens: prepared.__setitem__(0, 1.5))
    assert first.stats["capture_s"] == 1.5 and gone() is None
    gone = cyclic_garbage()
    second = gen.generate([[1, 2, 3, 1, 2]], config)
    assert second.stats["capture_s"] == 0 and gone() is not None


def test_warm_up_says_what_it_prepares_for_a_status_line(targets, monkeypatch):
    """While warm_up runs, ``engine.warming`` names the part being prepared (what ``longspec
    serve``'s status line prints every ~2 s); None before and after."""
    from longspec.status import Heartbeat
    from longspec.engine import runner as runner_module
    from longspec.engine.engine import Engine

    engine = Engine(targets["llama"], PromptLookup(), TreeSpec.parse("2,2"), max_batch=2, max_len=64)
    seen = []
    monkeypatch.setattr(runner_module.PhaseRunner, "prepare", lambda self: seen.append(engine.warming))
    assert engine.warming is None
    engine.warm_up(sampled=True)
    assert engine.warming is None
    assert seen == ["bucket 1's greedy rounds", "bucket 2's greedy rounds", "bucket 1's sampled rounds",
                    "bucket 2's sampled rounds", "bucket 1's sampled (top-k / top-p) rounds",
                    "bucket 2's sampled (top-k / top-p) rounds"]
    assert list(engine.warm_up_seconds) == ["the prefill", *seen, "the proposer's take-in", "garbage collection"]
    assert min(engine.warm_up_seconds.values()) >= 0
    lines = []
    monkeypatch.setattr("longspec.status.status", lines.append)
    with Heartbeat(lambda: "warming up", every=0.05):
        time.sleep(0.3)
    assert lines and all(line.startswith("warming up: ") and line.endswith(" s so far") for line in lines)


def test_warm_up_tells_the_proposer_each_kind_of_round(targets, monkeypatch):
    """Each runner is prepared (captured, on CUDA) with the proposer drafting for its kind of
    round: greedy rounds never draw children from the draft distribution; and a proposer that
    cannot run on part of the batch gets one bucket."""
    from longspec.engine import runner as runner_module
    from longspec.engine.engine import Engine
    from longspec.spec.proposers import Proposer
    from longspec.spec.sampling import RowSampling

    seen = {}
    monkeypatch.setattr(runner_module.PhaseRunner, "prepare",
                        lambda self: seen.setdefault(id(self), self.phases[0].args[0].proposer.sample_children))
    target = targets["llama"]
    engine = Engine(target, PromptLookup(), TreeSpec.parse("chain:3"), max_batch=2, max_len=64,
                    config=RowSampling.zeros(2, "cpu"))
    engine.warm_up(sampled=True)
    assert {key: seen[id(r)] for key, r in engine.runners.items()} == {
        (True, False, 1): False, (True, False, 2): False, (False, False, 1): True, (False, False, 2): True,
        (False, True, 1): True, (False, True, 2): True}

    class Whole(Proposer):  # no rows(): not narrowable
        def begin(self, target, cache, tree, config, rng):
            pass

    assert Engine(target, Whole(), TreeSpec.parse("chain:2"), max_batch=4, max_len=64).buckets == [4]


def test_one_engine_serves_every_length_and_is_freed_at_once_when_replaced(targets, automatic_gc_off):
    """Calls with other prompt lengths, max_new_tokens and sampling settings reuse the generator's
    engine (its pool, proposer state and graphs); a call with more prompts than it has rows
    replaces it, and the old one is released (its caches) without waiting for a garbage
    collection: the engine holds no reference cycle once closed."""
    import weakref

    target = targets["llama"]
    gen = Generator(target, PromptLookup(), "2,2")
    gen.generate([prompts_for(1, seed=1)[0]], GenerationConfig(max_new_tokens=5, ignore_eos=True))
    first = gen._engine
    gen.generate([prompts_for(1, seed=2)[0][:7]], GenerationConfig(max_new_tokens=9, ignore_eos=True))
    gen.generate([prompts_for(1, seed=3)[0]], GenerationConfig(max_new_tokens=4, temperature=0.7, seed=1))
    assert gen._engine is first
    assert Generator(target, gen.proposer, "2,2")._engine is None  # (built on its first call)
    old = weakref.ref(first)
    del first
    gen.generate(prompts_for(2, seed=4), GenerationConfig(max_new_tokens=9, ignore_eos=True))
    assert old() is None and len(gen._engine.rows) == 2


def test_a_targets_engines_live_as_long_as_the_target(tiny_model_factory):
    """The engines, proposers and auto's controllers a process keeps for a target belong to one
    object the target holds (``Engines.of``): Generators made call by call share them, and they
    go with the target, not before (a module-level store would keep every target alive)."""
    import gc
    import weakref

    from longspec import load_target
    from longspec.decoding.shared import Engines

    _, path = tiny_model_factory("spec-llama", "llama", max_position_embeddings=512, seed=3)
    target = load_target(path)
    prompt = prompts_for(1, seed=5)[0]
    for _ in range(2):
        Generator(target, "pld").generate([prompt], GenerationConfig(max_new_tokens=4, ignore_eos=True))
    engines = Engines.of(target)
    assert target.engines is engines and len(engines.engines) == 1
    engine = weakref.ref(next(iter(engines.engines.values())))
    gone = weakref.ref(target)
    del target, engines
    gc.collect()
    assert gone() is None and engine() is None


@pytest.mark.parametrize("kind", ["pld", "hybrid"])
def test_the_old_cache_is_freed_before_a_new_engine_allocates(targets, kind, monkeypatch):
    """A proposer kept for the target's next engine (one with more rows) no longer holds the old
    engine's KV pool (and views of it) while the new one is allocated: peak memory stays one
    pool. A later generator of the same target and proposer reuses the engine."""
    import weakref

    from longspec.models.draft import DraftConfig, init_draft

    target = targets["llama"]
    proposer = (PromptLookup() if kind == "pld" else
                LongSpecProposer(init_draft(DraftConfig.for_target(target, window=16), target, seed=0), PromptLookup()))
    gen = Generator(target, proposer, "2,2")
    gen.generate([prompts_for(1, seed=1)[0]], GenerationConfig(max_new_tokens=5, ignore_eos=True))
    old_pool = weakref.ref(gen._engine.pool.k)
    alive_at_allocation = []
    new_cache = target.new_cache

    def recording_new_cache(*args, **kwargs):
        alive_at_allocation.append(old_pool() is not None)
        return new_cache(*args, **kwargs)

    monkeypatch.setattr(target, "new_cache", recording_new_cache)
    gen.generate(prompts_for(2, seed=2), GenerationConfig(max_new_tokens=9, ignore_eos=True))
    assert alive_at_allocation == [False]
    engine = gen._engine
    del gen
    again = Generator(target, proposer, "2,2")
    again.generate([prompts_for(1, seed=3)[0]], GenerationConfig(max_new_tokens=3, ignore_eos=True))
    assert again._engine is engine and alive_at_allocation == [False]


def test_sampled_prefill_after_a_captured_round_draws_fresh_numbers(targets):
    """A request joining with sampling after rounds used a static random buffer (as captured
    CUDA-graph rounds do) draws its first token from fresh numbers, not past that buffer's end."""
    from longspec.engine.engine import Engine, Sequence
    from longspec.spec.sampling import RowSampling

    target = targets["llama"]
    engine = Engine(target, PromptLookup(), TreeSpec.parse("2,2"), max_batch=2, max_len=64,
                    config=RowSampling.zeros(2, "cpu"))
    engine.uniforms.make_static(3)
    engine.uniforms.used = 3  # a round consumed the whole static buffer
    seq = Sequence(prompts_for(1, seed=3)[0], 4, temperature=1.0)
    engine.add([seq])
    while engine.has_active:
        engine.step()
    assert len(seq.tokens) == 4


def test_collector_paused_collects_first_and_pauses():
    """Captures run inside ``collector_paused``: dead reference cycles are collected before the
    block (so a dead engine's CUDA graphs are never reset mid-capture) and the automatic
    collector (and Dynamo's collection after a compilation) stays off inside it, on again after
    (also after an error)."""
    import gc

    from longspec.engine.runner import collector_paused

    collected = []

    class Cycle:
        def __del__(self):
            collected.append(1)

    def make_dead_cycle():
        c = Cycle()
        c.me = c

    assert gc.isenabled()
    make_dead_cycle()
    import torch._dynamo

    with collector_paused():
        assert collected == [1]
        assert not gc.isenabled() and not torch._dynamo.config.run_gc_after_compile
    assert gc.isenabled() and torch._dynamo.config.run_gc_after_compile
    with pytest.raises(KeyError), collector_paused():
        raise KeyError("boom")
    assert gc.isenabled()


def test_a_launched_round_is_finished_before_anything_else(targets):
    """Engine.launch starts a round and returns, Engine.finish takes its tokens: a second launch,
    a switch to a tree that takes the rows in (the proposer reads their text) behind more than one
    plain round or a finish with nothing running is refused (a switch to plain rounds is not: the
    next rounds run them; nor one that takes the rows in behind one plain round: their text is
    the host's, their next token on the device); launch + finish is a step."""
    from longspec.engine.engine import Engine, Sequence

    target = targets["qwen3"]
    prompt = prompts_for(1, seed=25)[0]
    alone = Generator(target).generate([prompt], GenerationConfig(max_new_tokens=16, ignore_eos=True)).sequences[0]
    engine = Engine(target, PromptLookup(), TreeSpec.chain(3), max_len=96)
    seq = Sequence(prompt, 16)
    engine.add([seq])
    with pytest.raises(RuntimeError, match="no round is running"):
        engine.finish()
    engine.launch()
    with pytest.raises(RuntimeError, match="finish"):
        engine.launch()
    engine.use_tree(None)
    engine.finish()
    engine.launch()
    engine.launch(ahead=True)
    with pytest.raises(RuntimeError, match="takes the rows in"):
        engine.use_tree(TreeSpec.chain(3))
    engine.finish()
    engine.use_tree(TreeSpec.chain(3))
    engine.finish()
    while engine.has_active:
        engine.launch()
        engine.finish()
    assert seq.tokens == alone


@pytest.mark.parametrize("proposer", ["none", "pld", "hybrid"])
def test_rounds_launched_ahead_give_each_row_its_own_tokens(targets, proposer):
    """Engine.launch(ahead=True) starts a round before the one in flight is read, where every row
    has room for both (Engine.can_launch_ahead): rows with different budgets, one of which meets
    its EOS while a round launched after is in flight (its part of that round dropped), each get
    exactly the tokens they get alone; launching ahead is refused where a row might lack room."""
    from longspec.engine.engine import Engine, Sequence
    from longspec.models.draft import DraftConfig, init_draft

    target = targets["qwen3"]
    prompts = prompts_for(3, seed=26)
    budgets = [7, 15, 11]
    config = [GenerationConfig(max_new_tokens=n, ignore_eos=True) for n in budgets]
    alone = [Generator(target).generate([p], c).sequences[0] for p, c in zip(prompts, config)]
    eos = alone[1][5]  # row 1 stops at its sixth token (or before, where it repeats)
    stop = alone[1].index(eos) + 1
    if proposer == "hybrid":
        draft = LongSpecProposer(init_draft(DraftConfig.for_target(target, window=8), target, seed=2), PromptLookup())
    else:
        draft = {"none": None, "pld": PromptLookup()}[proposer]
    tree = None if draft is None else TreeSpec.parse("2,2")
    engine = Engine(target, draft, tree, max_batch=3, max_len=96)
    seqs = [Sequence(p, n, frozenset([eos]) if i == 1 else frozenset()) for i, (p, n) in
            enumerate(zip(prompts, budgets))]
    engine.add(seqs)
    ahead = 0
    while engine.has_active:
        if not engine.in_flight:
            engine.launch()
        while engine.can_launch_ahead():
            if engine.in_flight == 2:
                break
            engine.launch(ahead=True)
            ahead += 1
        engine.finish()
    assert ahead > 0 and not engine.in_flight
    assert [seqs[0].tokens, seqs[1].tokens, seqs[2].tokens] == [alone[0], alone[1][:stop], alone[2]]
    # room: a round in flight may emit (depth + 1) tokens; no launch ahead within that of the budget
    width = 1 if tree is None else tree.depth + 1
    seq = Sequence(prompts[0], 1 + width + 1)
    engine.add([seq])
    engine.launch()
    assert engine.can_launch_ahead()
    engine.finish()
    engine.launch()
    with pytest.raises(RuntimeError, match="running"):
        engine.launch(ahead=True)
    assert not engine.can_launch_ahead()
    while engine.in_flight:
        engine.finish()
    while engine.has_active:
        engine.step()


def test_an_engine_takes_sampling_settings_per_row_only(targets):
    """An engine's rows each sample with their own sequence's settings: a GenerationConfig for the
    whole engine is refused with a clear error (settings go on each Sequence)."""
    from longspec.engine.engine import Engine

    with pytest.raises(TypeError, match="RowSampling.*each Sequence carries"):
        Engine(targets["llama"], None, None, max_len=64, config=GenerationConfig(temperature=0.7))


def test_on_a_cpu_a_lookup_chain_drafts_only_where_two_tokens_match(targets, monkeypatch):
    """On a CPU (rounds run eagerly) a prompt-lookup chain round in which no row matched 2 tokens
    of its tail or more verifies the root alone, a decode step (the engine says it decoded), and
    one where a row did verifies the whole chain; the tokens are plain decoding's either way.
    Here a prompt of distinct tokens starts with decode steps and its text's repeats bring
    whole chains."""
    from longspec.engine.engine import Engine, Sequence

    target = targets["llama"]
    prompt = list(range(20, 60))
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    plain = Generator(target).generate([prompt], config).sequences[0]
    widths, verify = [], target.verify
    monkeypatch.setattr(target, "verify",
                        lambda tokens, *a, **k: widths.append(tokens.shape[1]) or verify(tokens, *a, **k))
    engine = Engine(target, PromptLookup(), TreeSpec.chain(4), max_batch=1, max_len=96)
    seq = Sequence(prompt, 40)
    engine.add([seq])
    decoded = []
    while engine.has_active:
        engine.step()
        decoded.append(engine.decoded)
    assert seq.tokens == plain
    assert decoded == [w == 1 for w in widths] and set(widths) == {1, 5} and widths[0] == 1, widths
