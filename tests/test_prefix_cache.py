"""The prefix cache over the KV block pool: the index (matching whole blocks, reference counts,
least-recently-used eviction that never touches a held block); engines that reuse cached prefixes
decode exactly what cold requests do, for every proposer, greedy and seeded sampling; prompts that
share a prefix, diverge inside a block and extend each other's answers (a chat); concurrent
requests on one prefix while another is evicted; a pool too small to keep anything. After every
test every block is free or cached (none leaked)."""
from __future__ import annotations

import pytest
import torch

from longspec import GenerationConfig, load_target
from longspec.kv.cache import BlockPool, KVCache, PoolExhausted
from longspec.engine.engine import Engine, Sequence
from longspec.decoding.generator import Generator
from longspec.spec.proposers import LongSpecProposer, PromptLookup
from longspec.spec.streaming import StreamingSelfSpec
from longspec.spec.tree import TreeSpec
from longspec.models.draft import DraftConfig, init_draft
from longspec.kv.prefix_cache import Hit, PrefixCache

BLOCK = 16


@pytest.fixture(scope="module")
def target(tiny_model_factory):
    return load_target(tiny_model_factory("prefix-llama", "llama", max_position_embeddings=512, seed=11)[1])


def tokens(n: int, seed: int) -> list:
    return torch.randint(0, 160, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def proposer(target, name: str):
    """(proposer, tree) of ``name``; none: (None, None)."""
    if name == "none":
        return None, None
    draft = init_draft(DraftConfig.for_target(target, window=16), target, seed=2)
    made = {"pld": (PromptLookup(), "chain:4"), "longspec": (LongSpecProposer(draft), "3,4,4"),
            "hybrid": (LongSpecProposer(draft, PromptLookup()), "3,4,4,1,1"),
            "streaming": (StreamingSelfSpec(window=8, sinks=2), "2,2")}[name]
    return made[0], TreeSpec.parse(made[1])


def engine_for(target, name="none", max_batch=2, max_len=256, pool_tokens=None, **kw) -> Engine:
    prop, tree = proposer(target, name)
    return Engine(target, prop, tree, max_batch=max_batch, max_len=max_len, pool_tokens=pool_tokens,
                  block_size=BLOCK, cuda_graphs=False, prefix_cache=True, **kw)


def run(engine: Engine, prompts: list, n: int = 10, **sampling) -> list:
    """Admits ``prompts`` together (``sampling``: their temperature, top_k, top_p; default
    greedy), decodes them to the end; returns their sequences."""
    seqs = [Sequence(p, n, **sampling) for p in prompts]
    engine.add(seqs)
    while engine.has_active:
        engine.step()
    return seqs


def cold(target, prompt: list, n: int = 10, config: GenerationConfig = None) -> list:
    """The tokens of ``prompt`` decoded alone, plainly, with no cache to reuse."""
    return Generator(target, prefix_cache=False).generate([prompt], config or GenerationConfig(max_new_tokens=n, ignore_eos=True),
                                      ).sequences[0]


def assert_no_leak(engine: Engine) -> None:
    """Every block of the pool is free or cached and idle; no row holds one."""
    prefix = engine.prefix
    assert not engine.has_active and not prefix.refs
    assert engine.pool.num_free + len(prefix.idle) == engine.pool.num_blocks
    assert set(prefix.idle) == set(prefix.blocks)


# ---- the index ---------------------------------------------------------------------------------

def test_index_matches_whole_blocks_keeps_held_blocks_and_evicts_the_least_recently_used(target):
    pool = BlockPool(target.config, num_blocks=6, block_size=4)
    cache = PrefixCache(pool)
    a = cache.allocate(3)
    prompt = list(range(10))  # blocks [0..3], [4..7] full; [8, 9] partial
    cache.register(a, prompt)
    assert len(cache.blocks) == 2 and cache.match(prompt) == Hit(a[:2])
    # the last token is always computed: one whole block, and the next one's first 3 tokens (copied)
    assert cache.match(prompt[:8]) == Hit(a[:1], a[1], 3)
    assert cache.match(prompt[:6] + [99, 7, 8]) == Hit(a[:1], a[1], 2)  # diverges inside the second block
    assert cache.match([99] + prompt[1:]) == Hit([])
    cache.release(a)  # the unindexed third block goes back to the pool; the two indexed ones stay
    assert pool.num_free == 4 and list(cache.idle) == [a[1], a[0]]  # the chain's tail first out
    hit = cache.match(prompt)
    cache.acquire(hit.blocks)  # held: never evicted
    assert len(cache.pinned([hit, hit])) == 0 and cache.num_free == 4
    assert len(cache.pinned([cache.match([0, 1, 2, 3, 4, 5, 9])])) == 0  # (held blocks)
    with pytest.raises(PoolExhausted, match="5 blocks of 4 tokens needed, 4 of 6 free or evictable"):
        cache.allocate(5)
    cache.release(hit.blocks)
    assert len(cache.pinned([cache.match([0, 1, 2, 3, 4, 5, 9])])) == 1  # idle: an admission would hold it
    # (the second block matches only in part: copied before the admission allocates, not held)
    b = cache.allocate(5)  # takes the four free blocks and evicts the tail block first
    assert cache.evicted == 1 and a[1] in b and a[0] not in b and cache.match(prompt) == Hit(a[:1])
    cache.register(b, [7] * 20)  # another content: its own chain
    cache.release(b)
    assert pool.num_free + len(cache.idle) == 6 and not cache.refs
    with pytest.raises(RuntimeError, match="released twice"):
        cache.release(b[:1])
    cache.acquire(b[-1:])
    cache.release(b[-1:])  # used again: the chain's head is now older than its tail
    cache.allocate(pool.num_free + len(cache.idle))  # evicts every block, the head before its follower
    assert not cache.blocks and not cache.idle and not cache.index


def test_a_prompt_is_matched_once_while_the_index_stays_the_same(target):
    cache = PrefixCache(BlockPool(target.config, num_blocks=8, block_size=4))
    prompt = list(range(13))
    assert cache.match(prompt) == Hit([])
    a = cache.allocate(3)
    cache.register(a, prompt[:12])  # the index changed: matched again
    first = cache.match(prompt)
    assert first == Hit(a) and cache.match(prompt) is first  # (a server checks it fits, then admits it)
    assert cache.match(list(prompt)) == first  # another list of the same tokens: matched anew
    cache.release(a)
    cache.allocate(8)  # evicts them: matched again
    assert cache.match(prompt) == Hit([])


def test_registering_after_the_blocks_a_row_took_from_the_cache_indexes_what_a_full_walk_does(target):
    """``register(indexed=k)`` (a row's first k blocks came from the cache: not walked again)
    leaves the index as registering every block does, a block whose content is cached
    elsewhere included."""
    def index_after(indexed: int) -> tuple:
        cache = PrefixCache(BlockPool(target.config, num_blocks=12, block_size=4))
        first = cache.allocate(3)
        cache.register(first, list(range(12)))  # blocks of tokens 0..3, 4..7, 8..11
        other = cache.allocate(3)
        cache.register(other, list(range(8)) + [50, 51, 52, 53])  # (its first two blocks: cached already)
        hit = cache.match(list(range(12)) + [60])
        cache.acquire(hit.blocks)
        row = hit.blocks + cache.allocate(3)
        cache.register(row, list(range(12)) + [60, 61, 62, 63, 64, 65, 66, 67, 68], last=True,
                       indexed=indexed)
        return {k: (cache.blocks[b].node, b) for k, b in cache.index.items()}, cache.children

    walked, from_hit = index_after(0), index_after(3)
    assert from_hit == walked and len(walked[0]) == 7


def test_a_row_whose_chain_began_in_another_rows_evicted_blocks_is_indexed_again_when_it_ends(target):
    """Two new prompts sharing their first block, admitted together: the second row's copy of it
    stays unindexed and its next block is indexed after the first row's. The first row ends and a
    third request evicts its blocks; when the second row ends, its blocks are indexed under its own
    chain (they were unreachable), and a prompt repeating its text finds them."""
    engine = Engine(target, None, None, max_batch=2, max_len=64, pool_tokens=32, block_size=4,
                    cuda_graphs=False, prefix_cache=True)
    t0, t1, u1 = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    a, b = Sequence(t0 + t1 + [13], 2), Sequence(t0 + u1 + [14], 10)
    engine.add([a, b])
    while not a.done:
        engine.step()
    engine.add([Sequence([20, 21, 22, 23, 24], 6)])  # its fresh blocks evict a's idle ones
    assert engine.prefix.evicted >= 2
    while engine.has_active:
        engine.step()  # b ends and indexes its blocks
    assert_no_leak(engine)
    again = Sequence(t0 + u1 + [14] + b.tokens[:4] + [15], 5)
    engine.add([again])
    assert again.cached_tokens >= 12
    while engine.has_active:
        engine.step()
    assert again.tokens == cold(target, again.prompt, 5)
    assert_no_leak(engine)


def test_a_rows_last_block_is_copied_in_part_and_taken_over_only_where_nothing_follows_it(target):
    """An ended row's partly filled last block is indexed too (``last``): a prompt going on from
    that text copies its tokens and takes the block over (its blocks stay consecutive); a block
    that other cached blocks follow is copied from and kept."""
    pool = BlockPool(target.config, num_blocks=10, block_size=4)
    cache = PrefixCache(pool)
    rows = KVCache(target.config, 1, 32, pool=pool, paged=True, allocator=cache)
    a = cache.allocate(3)
    cache.register(a, list(range(10)), last=True)  # [0..3] [4..7] [8, 9]
    cache.release(a)
    assert cache.match(list(range(8)) + [8, 7, 7]) == Hit(a[:2], a[2], 1)
    turn = Sequence(list(range(10)) + [5], 4)
    cache.assign(rows, [0], [turn], [16])
    assert turn.cached_tokens == 10 and rows.blocks[0] == a + [a[2] + 1] and a[2] not in cache.blocks
    rows.unassign(0)
    b = cache.allocate(4)
    cache.register(b, [7] * 16)  # four whole blocks
    cache.release(b)
    branch = Sequence([7] * 10 + [1, 2], 4)  # into the third block part of the way: it has a follower
    cache.assign(rows, [0], [branch], [16])
    assert branch.cached_tokens == 10 and rows.blocks[0][2] != b[2] and b[2] in cache.blocks
    rows.unassign(0)
    assert pool.num_free + len(cache.idle) == 10 and not cache.refs
    # admitted together: one prompt holds the second block whole, the other goes into it part of the
    # way (and would take it over, were it not held)
    c = cache.allocate(2)
    cache.register(c, [3] * 8)
    cache.release(c)
    rows = KVCache(target.config, 2, 32, pool=pool, paged=True, allocator=cache)
    whole, part = Sequence([3] * 9, 4), Sequence([3] * 6 + [1, 1], 4)
    cache.assign(rows, [0, 1], [part, whole], [16, 16])
    assert rows.blocks[1][:2] == c and rows.blocks[0][0] == c[0] and c[1] not in rows.blocks[0]
    assert (whole.cached_tokens, part.cached_tokens) == (8, 6) and cache.refs[c[1]] == 1
    rows.unassign(0)
    rows.unassign(1)
    assert pool.num_free + len(cache.idle) == 10 and not cache.refs


def test_copies_of_partly_matching_blocks_read_every_source_before_writing_any_target(target):
    """``copy_slots``: a source that is also another copy's target is read first; a block copied
    onto itself (a row that took its partial block over) is left as it is."""
    pool = BlockPool(target.config, num_blocks=6, block_size=4)
    for x in (pool.k, pool.v):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(3)))
    before_k, before_v = pool.k.clone(), pool.v.clone()
    PrefixCache(pool).copy_slots([(1, 2, 3), (2, 3, 2), (4, 4, 4)])
    for now, was in ((pool.k, before_k), (pool.v, before_v)):
        assert torch.equal(now[:, :, 8:11], was[:, :, 4:7])  # block 1's first 3 slots into block 2
        assert torch.equal(now[:, :, 12:14], was[:, :, 8:10])  # block 2's, as they were, into block 3
        assert torch.equal(now[:, :, 11:12], was[:, :, 11:12]) and torch.equal(now[:, :, 14:], was[:, :, 14:])
        assert torch.equal(now[:, :, :8], was[:, :, :8])


# ---- engines -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["none", "pld", "streaming", "longspec", "hybrid"])
def test_questions_about_one_document_and_a_chat_decode_what_cold_requests_do(target, name):
    """A document and three questions one after another, then a second turn (first turn's prompt +
    answer + a new question): each later request reuses the cached blocks (whole blocks before the
    last token) and decodes plain decoding's tokens, with the proposer drafting what it drafts for
    a cold request (the same accepted lengths, round by round: its state is a cold prefill's)."""
    doc, questions = tokens(75, 1), [tokens(n, 10 + n) for n in (5, 21, 3)]
    engine = engine_for(target, name)
    alone = Engine(target, *proposer(target, name), max_batch=2, max_len=256, block_size=BLOCK, cuda_graphs=False)

    def check(prompt):  # the same requests through an engine without a prefix cache
        s, c = Sequence(prompt, 10), Sequence(prompt, 10)
        engine.add([s])
        alone.add([c])
        if engine.proposer is not None:  # its state after admission (the draft's window, the lookup's history)
            for mine, theirs in zip(engine.proposer.state_tensors(), alone.proposer.state_tensors()):
                assert torch.equal(mine[0], theirs[0])
        for e in (engine, alone):
            while e.has_active:
                e.step()
        assert s.tokens == c.tokens == cold(target, prompt)
        assert s.accepted_hist == c.accepted_hist
        return s

    for q in questions:
        check(doc + q)
    # the first question was cold; the others share the document's 4 whole blocks and the first
    # 11 tokens of the first question's fifth block (copied)
    assert engine.prefix.hit_tokens == 2 * 75
    turn1 = doc + questions[1]
    turn2 = turn1 + cold(target, turn1) + tokens(7, 3)
    s = check(turn2)
    # every committed token of turn 1 is cached: its answer's last block too (copied); the last token
    # of the answer was committed only if a round accepted it as a draft (not as the bonus token)
    assert s.cached_tokens in (len(turn1) + 9, len(turn1) + 10)
    assert_no_leak(engine)


@pytest.mark.parametrize("name", ["none", "hybrid"])
def test_a_cached_row_in_runs_of_blocks_is_attended_run_by_run(target, name, monkeypatch):
    """One request at a time on a CPU: a cached request's row (the document's blocks, then its own
    elsewhere in the pool) is attended run by run (no gather), its tail's prefill (causal) as its
    decode steps, and it decodes what a cold request does."""
    from longspec.attention import backend

    calls = []
    real = backend.runs_attention
    monkeypatch.setattr(backend, "runs_attention",
                        lambda q, k, v, runs: calls.append((len(runs), q.shape[2])) or real(q, k, v, runs))
    engine = engine_for(target, name, max_batch=1)
    doc = tokens(70, 4)
    first, second = run(engine, [doc + tokens(9, 5)]), run(engine, [doc + tokens(6, 6)])
    assert second[0].cached_tokens == 70 and calls and min(n for n, _ in calls) >= 2
    assert (2, 6) in calls  # the tail after the 70 cached tokens, prefilled over two runs
    assert first[0].tokens == cold(target, doc + tokens(9, 5)) and second[0].tokens == cold(target, doc + tokens(6, 6))
    assert_no_leak(engine)


def test_prompts_that_share_a_prefix_and_diverge_inside_a_block_admitted_together(target):
    """Two prompts admitted in one batch after a cached prefix: one diverges inside a cached
    block (it shares the blocks before and copies that block's first tokens), the other inside
    the partly filled block after the prefix; rows with different cached lengths are prefilled
    apart and both decode exactly."""
    base = tokens(60, 4)
    engine = engine_for(target, "pld")
    run(engine, [base])
    inside = base[:40] + tokens(12, 5)  # diverges at 40: inside the third block (32..47)
    after = base[:50] + tokens(12, 6)
    seqs = run(engine, [inside, after])
    assert [s.cached_tokens for s in seqs] == [40, 50]
    assert [s.tokens for s in seqs] == [cold(target, inside), cold(target, after)]
    assert_no_leak(engine)


def test_requests_sharing_a_prefix_run_while_another_prefix_is_evicted(target):
    """A pool of 14 blocks: prefix X's blocks are cached, then prefix Y's.
    Two requests on X are admitted together (holding X's blocks twice), then a long third request
    needs blocks: only Y's idle blocks are evicted, never X's held ones; all three decode exactly."""
    x, y = tokens(64, 7), tokens(64, 8)
    engine = engine_for(target, "longspec", max_batch=3, pool_tokens=14 * BLOCK)
    run(engine, [x + [1]], n=2)
    run(engine, [y + [2]], n=2)
    assert len(engine.prefix.idle) == 10 and engine.pool.num_free == 4  # 4 whole blocks and a last one each
    sharing = [Sequence(x + tokens(4, 20), 10), Sequence(x + tokens(9, 21), 10)]
    engine.add(sharing)  # 4 cached blocks each, held twice, and 2 fresh blocks each
    held = set(engine.prefix.match(x + [0]).blocks)
    assert all(engine.prefix.refs[b] == 2 for b in held) and not held & set(engine.prefix.idle)
    long = Sequence(tokens(70, 9), 10)
    assert engine.blocks.can_admit([long])
    engine.add([long])
    assert engine.prefix.evicted > 0 and engine.prefix.match(y + [0]) == Hit([]) and set(engine.prefix.match(x + [0]).blocks) == held
    while engine.has_active:
        engine.step()
    assert [s.tokens for s in sharing + [long]] == [cold(target, s.prompt) for s in sharing + [long]]
    assert_no_leak(engine)


def test_a_pool_of_one_request_evicts_as_it_goes_and_waits_when_short(target):
    """A pool that holds one request: different prompts evict each other's cached blocks; a
    second request is refused while the first holds the pool, admitted once it ends; outputs exact."""
    engine = engine_for(target, "pld", max_len=128, pool_tokens=128)
    prompts = [tokens(90, 30 + i) for i in range(3)]
    for p in prompts:
        (s,) = run(engine, [p])
        assert s.tokens == cold(target, p)
    assert engine.prefix.evicted > 0
    first, second = Sequence(prompts[0], 10), Sequence(prompts[1], 10)
    engine.add([first])
    assert not engine.blocks.can_admit([second])
    with pytest.raises(PoolExhausted):
        engine.add([second])
    while engine.has_active:
        engine.step()
    assert engine.blocks.can_admit([second])
    run(engine, [prompts[1]])
    assert_no_leak(engine)


def test_seeded_sampling_draws_the_same_tokens_cached_and_cold(target):
    """A seeded call's tokens, through the hybrid proposer, are the same on a cold engine and on
    an engine that has the prompt's prefix cached (the cached K/V are the prefill's)."""
    doc = tokens(70, 12)
    sampled = dict(temperature=0.8, top_p=0.9)
    prop, tree = proposer(target, "hybrid")
    outputs = []
    for warm in (False, True):
        engine = Engine(target, prop, tree, max_batch=1, max_len=256, block_size=BLOCK, cuda_graphs=False,
                        prefix_cache=True)
        if warm:
            run(engine, [doc + [5]], n=3, **sampled)
        engine.uniforms.generator = torch.Generator().manual_seed(5)
        (s,) = run(engine, [doc + [9, 9]], n=12, **sampled)
        assert s.cached_tokens == (4 * BLOCK + 6 if warm else 0)  # (then doc's last 6 tokens, copied)
        outputs.append(s.tokens)
        assert_no_leak(engine)
        engine.close()
    assert outputs[0] == outputs[1]


def test_generator_calls_reuse_the_prefixes_of_earlier_calls(target):
    gen = Generator(target, "pld", max_len=256)
    config = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    doc = tokens(140, 13)
    first = gen.generate([doc + [1]], config)
    second = gen.generate([doc + [2, 3]], config)
    assert first.stats["cached_tokens"] == 0 and second.stats["cached_tokens"] >= 128
    assert second.sequences[0] == cold(target, doc + [2, 3], 8)


def test_a_partly_matching_block_evicted_by_its_own_admission_is_copied_from(target):
    """The block a prompt goes on into part of the way is not held: a request whose fresh blocks
    need that very block evicted is admitted (not refused for want of one block), its tokens
    copied after the allocation (which writes no block), and its output is exact."""
    engine = engine_for(target, "none", max_batch=1, max_len=128, pool_tokens=6 * BLOCK)
    a = tokens(40, 40)
    run(engine, [a], n=2)  # 2 whole blocks cached, and the last one (a's 41st token in it)
    prompt = a[:20] + tokens(60, 41)  # the first block whole, the first 4 tokens of the second
    (s,) = run(engine, [prompt])  # 6 blocks: the shared one and 5 fresh (3 free + the evicted third and second)
    assert s.cached_tokens == 20 and engine.prefix.evicted == 2
    assert s.tokens == cold(target, prompt)
    assert_no_leak(engine)


def test_chunked_prefill_after_a_cached_prefix(target):
    """Prompts prefilled in fixed-size chunks start after their cached tokens (not at a chunk
    boundary) and decode exactly."""
    engine = engine_for(target, "pld", prefill_chunk=BLOCK)
    doc = tokens(70, 50)
    for q in ([1, 2, 3], tokens(25, 51)):
        (s,) = run(engine, [doc + q])
        assert s.tokens == cold(target, doc + q)
    assert s.cached_tokens == 70 and engine.chunked_prefill.runners  # (the chunks ran)
    assert_no_leak(engine)


def test_a_cached_prefix_requests_rest_goes_in_a_small_chunk(target):
    """Chunks of 128 tokens and 16 (the default ladder of 128): a 73-token cold prompt runs one
    128-token step; a question after the same document, the document's tokens cached, one
    16-token step; both decode exactly."""
    engine = engine_for(target, "pld", prefill_chunk=128)
    chunked = engine.chunked_prefill
    assert chunked.sizes == (16, 128)
    doc = tokens(70, 50)
    for q, steps in (([1, 2, 3], {128: 1}), (tokens(5, 52), {16: 1})):
        before = dict(chunked.steps_run)
        (s,) = run(engine, [doc + q])
        assert s.tokens == cold(target, doc + q)
        assert {k: v - before.get(k, 0) for k, v in chunked.steps_run.items() if v > before.get(k, 0)} == steps
    assert s.cached_tokens >= 64
    assert_no_leak(engine)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["pld", "hybrid", "streaming"])
def test_cached_prefixes_through_the_triton_kernels_and_cuda_graphs(tiny_model_factory, name):
    """On CUDA: 64-token blocks read through the table by the Triton kernels, rounds and prefill
    chunks captured as CUDA graphs, chunks starting after the cached tokens: the questions after
    a document and a second turn decode plain decoding's tokens."""
    target = load_target(tiny_model_factory("prefix-llama", "llama", max_position_embeddings=512, seed=11)[1],
                         device="cuda")
    target.compile_steps = False
    # chunks of 512, 64, 32 and 16 (the default ladder of 512): the document in one 512-token
    # chunk, each question's rest after the cached tokens (captured on first use) in a 16- or a
    # 32-token one
    engine = Engine(target, *proposer(target, name), max_batch=2, max_len=512, prefix_cache=True, prefill_chunk=512)
    doc = tokens(200, 60)
    for q in (tokens(5, 61), tokens(30, 62), tokens(3, 63)):
        (s,) = run(engine, [doc + q])
        assert s.tokens == cold(target, doc + q)
    assert set(engine.chunked_prefill.steps_run) == {16, 32, 512}
    turn2 = doc + q + s.tokens + tokens(9, 64)
    (s,) = run(engine, [turn2])
    assert s.cached_tokens >= len(doc) + 3 and s.tokens == cold(target, turn2)
    assert engine.runners and all(r.graphs is not None for r in engine.runners.values())
    assert_no_leak(engine)


def test_a_sequence_cancelled_while_its_tokens_go_out_is_released_once(target):
    """A streamer that cancels its sequence (a stop string) while the round hands the tokens over:
    the row is released once, its blocks cached, none leaked."""
    engine = engine_for(target, "pld")
    seq = Sequence(tokens(40, 70), 10)
    engine.add([seq])
    engine.step(streamer=lambda row, new: engine.cancel(seq))
    assert seq.done and not engine.has_active
    assert_no_leak(engine)


@pytest.mark.slow  # (about a minute and a half on a busy 2-core CPU)
def test_sampling_after_a_cached_prefix_matches_the_target_distribution(tiny_model_factory):
    """20000 rows, each reading a cached block and copying the first tokens of another, sample
    their first two tokens (one from the prefill, one from a speculative round) from the exact
    warped target distribution (chi-square, as ``test_speculative_sampling`` does cold)."""
    from test_speculative_sampling import assert_two_token_distribution

    target = load_target(tiny_model_factory("spec-v8", "llama", vocab_size=8, max_position_embeddings=128, seed=9)[1])
    prompt, n = [1, 5, 2, 7, 3, 0, 6], 20000
    config = GenerationConfig(max_new_tokens=2, temperature=0.8, top_p=0.9, seed=123, ignore_eos=True)
    engine = Engine(target, StreamingSelfSpec(window=2, sinks=1), TreeSpec.parse("chain:3"), max_batch=n, max_len=16,
                    block_size=4, cuda_graphs=False, prefix_cache=True)
    engine.uniforms.generator = torch.Generator().manual_seed(config.seed)
    sampled = dict(temperature=config.temperature, top_p=config.top_p)
    run(engine, [prompt[:6]], n=2, **sampled)  # caches [1, 5, 2, 7] and the row's last block [3, 0, x]
    seqs = run(engine, [prompt] * n, n=2, **sampled)
    assert {s.cached_tokens for s in seqs} == {6}
    assert_two_token_distribution(target, prompt, config, [s.tokens for s in seqs])
    assert_no_leak(engine)


def test_requests_of_different_namespaces_share_no_cached_tokens(target):
    """A tenant (``Sequence.cache_namespace``: an API key, a cache salt) reuses its own cached
    prompts, but another tenant's identical prompt, or one that goes on from a prefix of it (the
    audit's guessed PIN digit), reads nothing from them: ``cached_tokens`` 0, the same tokens as a
    cold request, and a partly matching block of another tenant is never copied."""
    engine = engine_for(target, "none")
    secret = tokens(70, 5)  # a whole block, then part of one
    first = Sequence(secret, 4, cache_namespace=("key A", None))
    engine.add([first])
    while engine.has_active:
        engine.step()
    own = Sequence(secret, 4, cache_namespace=("key A", None))
    other = Sequence(secret, 4, cache_namespace=("key B", None))
    salted = Sequence(secret[:69] + [secret[69]], 4, cache_namespace=("key A", "another salt"))
    guess = Sequence(secret[:66] + [7], 4)  # (the shared namespace: None)
    for s in (own, other, salted, guess):
        engine.add([s])
        while engine.has_active:
            engine.step()
    assert own.cached_tokens > 0
    assert other.cached_tokens == salted.cached_tokens == guess.cached_tokens == 0
    assert other.tokens == own.tokens == first.tokens == cold(target, secret, 4)
    assert_no_leak(engine)


def test_the_python_api_keeps_several_documents_within_its_kv_memory(target):
    """A Generator's pool holds one row by default on a CPU, so a document that comes back after
    two others was evicted; with ``kv_memory`` for four rows it is read from the cache, with the
    same output (``stats["kv_pool_tokens"]`` says the pool's size)."""
    from longspec.kv.cache import token_bytes

    docs = [tokens(300, seed) for seed in (31, 32, 33)]
    config = GenerationConfig(max_new_tokens=8)
    row_bytes = 512 * token_bytes(target.config, target.dtype)
    cached = {}
    for name, memory in (("one row", None), ("four rows", f"{4 * row_bytes / (1 << 30)!r}GiB")):
        gen = Generator(target, max_len=512, kv_memory=memory)
        outs = [gen.generate([doc], config) for doc in docs + [docs[0]]]
        assert outs[-1].sequences == outs[0].sequences
        cached[name] = (outs[-1].stats["cached_tokens"], outs[-1].stats["kv_pool_tokens"])
    assert cached["one row"] == (0, 512) and cached["four rows"][0] >= 256 and cached["four rows"][1] >= 4 * 512, cached
    with pytest.raises(ValueError, match="less than one row"):
        Generator(target, max_len=512, kv_memory="0.000001GiB")
