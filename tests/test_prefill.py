"""Chunked prefill (:class:`~longspec.engine.prefill.ChunkedPrefill`): the same K/V and logits
as the eager prefill, whatever the prompt's length against the chunk, and the same tokens from
an engine that prefills in chunks (rows joining between rounds, with and without a proposer)."""
import pytest
import torch

from longspec import GenerationConfig, load_target
from longspec.kv.cache import BlockPool
from longspec.engine.engine import Engine, Sequence
from longspec.decoding.generator import Generator
from longspec.engine.prefill import MODES, ChunkedPrefill, chunk_plan, default_sizes
from longspec.spec.proposers import LongSpecProposer, PromptLookup
from longspec.spec.tree import TreeSpec
from longspec.models.draft import DraftConfig, init_draft


@pytest.fixture(scope="module")
def target(tiny_model_factory):
    return load_target(tiny_model_factory("prefill", "qwen3", max_position_embeddings=256, seed=4)[1])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("length", [1, 15, 16, 17, 33, 50])
def test_chunks_write_the_eager_prefills_cache_and_logits(target, length, mode):
    """Prompts one off a chunk (and two chunks + 1), in every prefill mode -> the unchunked
    prefill's logits and K/V."""
    prompt = torch.randint(0, 160, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    eager = target.new_cache(2, 96)
    ref = target.prefill(torch.tensor([prompt]), torch.tensor([length]), eager.rows(1, 2))
    chunked_cache = target.new_cache(2, 96)
    chunked = ChunkedPrefill(target, chunked_cache, 16, None, cuda_graphs=False, mode=mode)
    assert chunked.fits(length)
    logits = chunked(1, prompt)
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
    assert chunked_cache.lengths.tolist() == [0, length] and chunked_cache.pending == 0
    torch.testing.assert_close(chunked_cache.k[:, 1, :, :length], eager.k[:, 1, :, :length], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked_cache.v[:, 1, :, :length], eager.v[:, 1, :, :length], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [15, 16, 17, 33])
def test_the_eager_prefills_chunks_give_the_unchunked_logits_and_cache(target, length):
    """``TargetModel.prefill`` in chunks of 16 over right-padded rows (one row one off the chunk,
    one shorter) -> the logits of every position and the K/V of one unchunked forward."""
    lengths = torch.tensor([length, max(1, length - 6)])
    ids = torch.randint(0, 160, (2, length), generator=torch.Generator().manual_seed(length))
    whole, chunked = target.new_cache(2, 64), target.new_cache(2, 64)
    ref = target.prefill(ids, lengths, whole, chunk_size=64, all_logits=True)
    out = target.prefill(ids, lengths, chunked, chunk_size=16, all_logits=True)
    last = target.prefill(ids, lengths, target.new_cache(2, 64), chunk_size=16)
    for row, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(out[row, :n], ref[row, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(last[row], ref[row, n - 1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(chunked.k[:, row, :, :n], whole.k[:, row, :, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(chunked.v[:, row, :, :n], whole.v[:, row, :, :n], atol=1e-5, rtol=1e-5)
    assert chunked.lengths.tolist() == lengths.tolist()


def test_a_prefill_by_layer_after_a_cached_prefix_appends_like_the_eager_prefill(target):
    """A row holding 21 tokens gets 19 more layer by layer (lower-right causal attention over
    the pool) -> the eager prefill's logits and K/V; a batch of rows is refused."""
    from longspec.models.layer_prefill import prefill_by_layer

    ids = torch.randint(0, 160, (1, 40), generator=torch.Generator().manual_seed(3))
    eager, by_layer = target.new_cache(1, 64), target.new_cache(1, 64)
    for cache in (eager, by_layer):
        target.prefill(ids[:, :21], torch.tensor([21]), cache)
    ref = target.prefill(ids[:, 21:], torch.tensor([19]), eager)
    out = prefill_by_layer(target, ids[:, 21:], by_layer, piece=8)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(by_layer.k[:, 0, :, :40], eager.k[:, 0, :, :40], atol=1e-5, rtol=1e-5)
    assert by_layer.lengths.tolist() == [40]
    with pytest.raises(ValueError, match="one row"):
        prefill_by_layer(target, ids[:, :4].expand(2, -1), target.new_cache(2, 64))
    with pytest.raises(ValueError, match="unknown prefill mode"):
        ChunkedPrefill(target, target.new_cache(1, 64), 16, None, cuda_graphs=False, mode="flash")


LADDER = (8, 16, 64)


def test_the_ladders_plans():
    """The default ladder; big chunks first, then the rest in the cheapest small chunks (checked
    against every combination of at most 8 steps); a plan that would pad past the cache's room
    pads least instead; every step holds a real token."""
    from itertools import combinations_with_replacement

    assert default_sizes(2048) == (64, 128, 256, 2048) and default_sizes(1024) == (32, 64, 128, 1024)
    assert default_sizes(16) == (16,) and default_sizes(128) == (16, 128) and default_sizes(256) == (16, 32, 256)
    sizes = default_sizes(2048)
    assert chunk_plan(30, sizes, 512) == [64]  # a question after a cached document: one small step
    assert chunk_plan(2 * 2048 + 30, sizes, 512) == [2048, 2048, 64]
    assert chunk_plan(70, sizes, 512) == [128]
    assert chunk_plan(300, sizes, 512) == [256, 64]
    assert chunk_plan(1000, sizes, 512) == [2048]  # a long rest: one big step, not four small ones
    for n in range(1, 2 * 2048 + 2):
        plan = chunk_plan(n, sizes, 512)
        assert plan[:n // 2048] == [2048] * (n // 2048) and sum(plan) - plan[-1] < n <= sum(plan), n
    for n in range(1, 64):
        cost = min(sum(c) + 16 * k for k in range(1, 9) for c in combinations_with_replacement(LADDER, k)
                   if sum(c) >= n)
        plan = chunk_plan(n, LADDER, 16)
        assert sum(plan) + 16 * len(plan) == cost, n
    assert chunk_plan(600, sizes, 512) == [256, 256, 128]
    assert chunk_plan(720, sizes, 512) == [256, 256, 256]
    assert chunk_plan(140, sizes, 512) == [256]
    assert chunk_plan(140, sizes, 512, room=192) == [128, 64]  # the cheapest pads to 256
    assert chunk_plan(140, sizes, 512, room=191) is None


def test_a_chunk_step_that_failed_leaves_the_next_rows_prefill_exact(target, monkeypatch):
    """One chunk step serves every row: a step that raised part-way (e.g. out of memory in the LM
    head, after the layers wrote their K/V) leaves no pending tokens behind for the next row."""
    prompt = torch.randint(0, 160, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    eager, chunked_cache = target.new_cache(1, 96), target.new_cache(2, 96)
    ref = target.prefill(torch.tensor([prompt]), torch.tensor([len(prompt)]), eager)
    chunked = ChunkedPrefill(target, chunked_cache, 16, None, cuda_graphs=False)
    logits = target.logits
    monkeypatch.setattr(target, "logits", lambda h: (_ for _ in ()).throw(RuntimeError("out of memory")))
    with pytest.raises(RuntimeError, match="out of memory"):
        chunked(0, prompt)
    monkeypatch.setattr(target, "logits", logits)
    torch.testing.assert_close(chunked(1, prompt), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked_cache.k[:, 1, :, :20], eager.k[:, 0, :, :20], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("start", [0, 21])
@pytest.mark.parametrize("length", [7, 8, 9, 15, 16, 17, 63, 64, 65])
def test_ladder_chunks_write_the_eager_prefills_cache_and_logits(target, length, start):
    """Prompts one off each size of an 8 / 16 / 64 ladder, into an empty row and after 21 cached
    tokens -> the eager prefill's logits and K/V; the steps run are the plan's."""
    ids = torch.randint(0, 160, (start + length,), generator=torch.Generator().manual_seed(length)).tolist()
    eager, laddered = target.new_cache(2, 160), target.new_cache(2, 160)
    for cache in (eager, laddered) if start else ():
        target.prefill(torch.tensor([ids[:start]]), torch.tensor([start]), cache.rows(1, 2))
    ref = target.prefill(torch.tensor([ids[start:]]), torch.tensor([length]), eager.rows(1, 2))
    chunked = ChunkedPrefill(target, laddered, LADDER, None, cuda_graphs=False, step_cost=16)
    plan = chunked.plan(length, start)
    logits = chunked(1, ids[start:], start)
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
    assert sorted(chunked.steps_run.elements()) == sorted(plan) and set(chunked.runners) == set(plan)
    n = start + length
    assert laddered.lengths.tolist() == [0, n] and laddered.pending == 0
    torch.testing.assert_close(laddered.k[:, 1, :, :n], eager.k[:, 1, :, :n], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(laddered.v[:, 1, :, :n], eager.v[:, 1, :, :n], atol=1e-5, rtol=1e-5)


def test_a_prompt_whose_last_chunk_does_not_fit_is_prefilled_eagerly(target):
    chunked = ChunkedPrefill(target, target.new_cache(1, 40), 16, None, cuda_graphs=False)
    assert chunked.fits(32) and not chunked.fits(33)  # 33 tokens: a third chunk padded to slot 48
    for chunk in (0, 41):  # a chunk longer than the cache would write past its slots
        with pytest.raises(ValueError, match="1 to 40 tokens"):
            ChunkedPrefill(target, target.new_cache(1, 40), chunk, None, cuda_graphs=False)


def test_long_prompts_go_layer_by_layer_short_ones_in_chunks(target, monkeypatch):
    """The captured mode sends a prompt of ``by_layer_from`` tokens or more through
    ``prefill_by_layer`` (no chunk step, no padded slots: 33 tokens fit 40 slots in 16-token
    chunks only that way), shorter ones through chunk steps; both give the eager prefill's logits."""
    chunked = ChunkedPrefill(target, target.new_cache(2, 40), 16, None, cuda_graphs=False)
    monkeypatch.setattr(chunked, "by_layer_from", 24)
    assert chunked.fits(33) and chunked.takes([33, 20], [0, 0]) and not chunked.fits(41)
    ids = torch.randint(0, 160, (33,), generator=torch.Generator().manual_seed(4)).tolist()
    for row, prompt in ((0, ids), (1, ids[:20])):
        eager = target.new_cache(1, 40)
        ref = target.prefill(torch.tensor([prompt]), torch.tensor([len(prompt)]), eager)
        torch.testing.assert_close(chunked(row, prompt), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(chunked.cache.k[:, row, :, :len(prompt)], eager.k[:, 0, :, :len(prompt)],
                                   atol=1e-5, rtol=1e-5)
    assert set(chunked.runners) == {16}  # the 20-token prompt's steps; the 33-token one went by layer


def test_sliding_window_targets_never_go_layer_by_layer(tiny_model_factory, monkeypatch):
    """prefill_by_layer has no sliding windows (nor Gemma's norms): a Gemma 3 target's long
    prompts stay in chunks, which give the eager prefill's logits past the window; asking for
    it by layer is a clear error."""
    from longspec.models.layer_prefill import prefill_by_layer, supports

    gemma = load_target(tiny_model_factory("gemma3", "gemma3", seed=3)[1])
    assert not supports(gemma.config)
    chunked = ChunkedPrefill(gemma, gemma.new_cache(1, 64), 16, None, cuda_graphs=False)
    monkeypatch.setattr(chunked, "by_layer_from", 8)
    prompt = torch.randint(0, 160, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    assert not chunked.by_layer(len(prompt)) and chunked.plan(len(prompt)) == [16, 16, 16]
    eager = gemma.new_cache(1, 64)
    ref = gemma.prefill(torch.tensor([prompt]), torch.tensor([len(prompt)]), eager)
    torch.testing.assert_close(chunked(0, prompt), ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="sliding-window"):
        ChunkedPrefill(gemma, gemma.new_cache(1, 64), 16, None, cuda_graphs=False, mode="layers")
    with pytest.raises(ValueError, match="sliding-window"):
        prefill_by_layer(gemma, torch.tensor([prompt]), gemma.new_cache(1, 64))


def test_warm_up_runs_a_prompt_by_layer_and_drops_its_tokens(target, monkeypatch):
    """The warm-up is a prompt by layer: each layer's causal attention with the target's query
    and KV heads (cuDNN's set-up is paid for the shapes the prompts by layer use); the row is
    left empty."""
    from longspec.models import layer_prefill

    seen, attend = [], layer_prefill.causal_attention
    monkeypatch.setattr(layer_prefill, "causal_attention",
                        lambda q, k, v: seen.append((q.shape, k.shape, q.dtype)) or attend(q, k, v))
    cache = target.new_cache(1, 32)
    layer_prefill.warm_up(target, cache, tokens=9)
    c = target.config
    assert seen == [((1, c.num_heads, 9, c.head_dim), (1, c.num_kv_heads, 9, c.head_dim), target.dtype)] * c.num_layers
    assert not cache.lengths.any()


def test_the_attention_of_prompts_by_layer_is_set_up_once_where_they_can_occur(target, monkeypatch):
    """prepare_by_layer (an engine's warm-up) sets the causal attention up once, only with CUDA
    graphs and only where a prompt can be long enough to go by layer; the chunk steps' preparation
    alone (what a Generator's call does) never does."""
    from longspec.models import layer_prefill

    calls = []
    warm_up = layer_prefill.warm_up
    monkeypatch.setattr(layer_prefill, "warm_up", lambda *a: calls.append(a) or warm_up(*a))
    # (prompts of both kinds of length, each at most max_len tokens)
    for max_len, graphs, expected in ((40, True, [9, 32]), (28, True, [9, 28]), (20, True, []), (40, False, [])):
        calls.clear()
        pool = BlockPool(target.cache_config, 24, 4, target.dtype, target.device)
        cache = target.new_cache(2, max_len, pool=pool, paged=True)  # rows taking blocks from a pool
        chunked = ChunkedPrefill(target, cache, 16, None, cuda_graphs=graphs)
        monkeypatch.setattr(chunked, "by_layer_from", 24)
        monkeypatch.setattr(chunked, "warm_tokens", (32, 9))
        chunked.prepare(0)
        assert calls == []
        chunked.prepare_by_layer()
        chunked.prepare_by_layer()
        # real prompts by layer ran (the path and layouts of the first ones), once, and left nothing behind
        assert [c[2] for c in calls] == expected, (max_len, graphs)
        assert not cache.lengths.any() and pool.num_free == pool.num_blocks
    # a pool with fewer free blocks than the prompt needs: a shorter prompt (nothing evicted); none free: none
    pool = BlockPool(target.cache_config, 14, 4, target.dtype, target.device)
    cache = target.new_cache(2, 40, pool=pool, paged=True)
    cache.assign(1, 40)  # 10 of 14 blocks held by row 1
    calls.clear()
    chunked = ChunkedPrefill(target, cache, 16, None, cuda_graphs=True)
    monkeypatch.setattr(chunked, "by_layer_from", 24)
    chunked.prepare_by_layer()
    assert [c[2] for c in calls] == [16] and pool.num_free == 4 and chunked.by_layer_ready
    cache.assign(0, 16)  # every block held
    chunked = ChunkedPrefill(target, cache, 16, None, cuda_graphs=True)
    monkeypatch.setattr(chunked, "by_layer_from", 24)
    chunked.prepare_by_layer()
    assert [c[2] for c in calls] == [16] and not chunked.by_layer_ready and cache.blocks[0] is not None


@pytest.mark.parametrize("chunk", [16, (8, 32)])
@pytest.mark.parametrize("proposer", ["none", "hybrid"])
def test_an_engine_prefilling_in_chunks_gives_the_same_tokens(target, proposer, chunk, monkeypatch):
    """Chunks of 16, and a ladder of 32- and 8-token chunks (prompts of 9 to 70 tokens in both
    sizes): the tokens of each prompt decoded alone, rows joining between rounds."""
    from test_speculative_engine import run_joining

    prompts = [torch.randint(0, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (9, 40, 16, 33, 70)]
    budgets = [8, 12, 6, 10, 7]
    alone = [Generator(target).generate([p], GenerationConfig(max_new_tokens=n, ignore_eos=True)).sequences[0]
             for p, n in zip(prompts, budgets)]
    draft = init_draft(DraftConfig.for_target(target, window=8), target, seed=2)
    make = {"none": lambda: None, "hybrid": lambda: LongSpecProposer(draft, PromptLookup())}[proposer]
    tree = None if proposer == "none" else TreeSpec.parse("2,3,3")
    engine = Engine(target, make(), tree, max_batch=3, max_len=100, prefill_chunk=chunk)
    monkeypatch.setattr(target, "prefill", lambda *a, **k: pytest.fail("an eager prefill ran"))
    engine.warm_up()  # every row's chunk step prepared on idle rows
    assert not engine.cache.lengths.any()
    seqs = [Sequence(p, n) for p, n in zip(prompts, budgets)]
    run_joining(engine, seqs)
    assert [s.tokens for s in seqs] == alone
    sizes = (16,) if chunk == 16 else chunk
    assert set(engine.chunked_prefill.runners) == set(sizes)  # one chunk step per size serves every row
    assert set(engine.chunked_prefill.steps_run) == set(sizes)


def test_a_large_admission_goes_as_one_eager_forward(target, monkeypatch):
    """Chunk steps are replayed row by row: an admission needing more than ``max_chunks`` of them
    in all is prefilled eagerly (one batched forward), a smaller one in chunks; the tokens are the
    same either way."""
    prompts = [torch.randint(0, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (20, 30, 12)]
    alone = [Generator(target).generate([p], GenerationConfig(max_new_tokens=5, ignore_eos=True)).sequences[0]
             for p in prompts]
    engine = Engine(target, None, None, max_batch=3, max_len=100, prefill_chunk=16)
    monkeypatch.setattr(engine.chunked_prefill, "max_chunks", 4)
    assert engine.chunked_prefill.takes([20, 30], [0, 0]) and not engine.chunked_prefill.takes([20, 30, 12], [0, 0, 0])
    eager, chunked = [], []
    prefill, call = target.prefill, ChunkedPrefill.__call__
    monkeypatch.setattr(target, "prefill", lambda *a, **k: eager.append(1) or prefill(*a, **k))
    monkeypatch.setattr(ChunkedPrefill, "__call__", lambda self, row, *a: chunked.append(row) or call(self, row, *a))
    seqs = [Sequence(p, 5) for p in prompts]
    engine.add(seqs[:2])  # 2 + 2 chunk steps: in chunks
    assert chunked == [0, 1] and not eager
    while engine.has_active:
        engine.step()
    engine.add([Sequence(p, 5) for p in prompts])  # 2 + 2 + 1 > 4: one eager forward
    assert eager == [1] and chunked == [0, 1]
    again = [s for s in engine.rows if s is not None]
    while engine.has_active:
        engine.step()
    assert [s.tokens for s in seqs[:2]] == alone[:2] and [s.tokens for s in again] == alone


@pytest.mark.parametrize("length", [17, 37])
@pytest.mark.parametrize("impl", ["sdpa", "triton"])
def test_chunks_told_their_mask_is_causal_write_the_same(target, impl, length):
    """``causal_kernel``: the chunk's mask passed as causal (the Triton kernel computes it and
    skips blocks; on a CPU in its interpreter) -> the eager prefill's K/V and logits."""
    from longspec.attention import triton_kernels

    if impl == "triton" and not triton_kernels.available():
        pytest.skip("needs triton")
    prompt = torch.randint(0, 160, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    eager = target.new_cache(1, 96)
    ref = target.prefill(torch.tensor([prompt]), torch.tensor([length]), eager)
    target.attention_impl = impl
    try:
        cache = target.new_cache(1, 96)
        logits = ChunkedPrefill(target, cache, 16, 96, cuda_graphs=False, causal_kernel=True)(0, prompt)
    finally:
        target.attention_impl = "sdpa"
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cache.k[:, 0, :, :length], eager.k[:, 0, :, :length], atol=1e-5, rtol=1e-5)


def test_causal_attention_in_kv_head_groups_equals_one_call(monkeypatch):
    """A prompt whose queries pass the per-call element limit runs in groups of KV heads (their
    query heads with them): the same output as one call."""
    from longspec.models import layer_prefill

    q = torch.randn(1, 24, 8, 4)  # [1, T, Hq, D]
    k, v = torch.randn(1, 4, 30, 4), torch.randn(1, 4, 30, 4)  # 6 cached tokens before the 24
    whole = layer_prefill.grouped_causal_attention(q, k, v)
    monkeypatch.setattr(layer_prefill, "MAX_CALL_ELEMENTS", q.numel() // 4)
    torch.testing.assert_close(layer_prefill.grouped_causal_attention(q, k, v), whole, atol=1e-6, rtol=1e-6)


def test_long_prefills_report_their_progress(target, capsys):
    """Inside ``prefill_progress`` the eager prefill reports after each chunk and the prefill by
    layer after each layer (fractions rising to 1); outside, nothing is reported; the CLI turns
    the reports into status lines."""
    from longspec.cli.commands import PrefillStatus
    from longspec.models.layer_prefill import prefill_by_layer
    from longspec.models.progress import prefill_progress

    ids = torch.randint(0, 160, (1, 40), generator=torch.Generator().manual_seed(5))
    seen = []
    with prefill_progress(seen.append):
        target.prefill(ids, torch.tensor([40]), target.new_cache(1, 64), chunk_size=16)
        assert seen == [16 / 40, 32 / 40, 1.0]
        seen.clear()
        prefill_by_layer(target, ids, target.new_cache(1, 64), piece=16)
        n = len(target.model.layers)
        assert seen == [(i + 1) / n for i in range(n)]
    seen.clear()
    target.prefill(ids, torch.tensor([40]), target.new_cache(1, 64), chunk_size=16)
    assert seen == []
    import time

    reporter = PrefillStatus(40, None, every=0.05)  # (a line every 0.05 s until the first token)
    stream = reporter.streamer(lambda row, tokens: None)
    with reporter.heartbeat:
        reporter(0.5)
        time.sleep(0.3)
        lines = capsys.readouterr().err.splitlines()
        stream(0, [7])
        time.sleep(0.3)
    assert len(lines) >= 2 and all(line.startswith("[longspec: prefilling the prompt's 40 tokens: 50%: ") for line in lines)
    assert capsys.readouterr().err.count("\n") <= 1  # (none after the first token, but one in flight)
