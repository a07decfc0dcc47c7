"""Chunked prefill (:class:`~longspec.decoding.prefill.ChunkedPrefill`): the same K/V and logits
as the eager prefill, whatever the prompt's length against the chunk, and the same tokens from
an engine that prefills in chunks (rows joining between rounds, with and without a proposer)."""
import pytest
import torch

from longspec import GenerationConfig, load_target
from longspec.decoding.engine import Engine, Sequence
from longspec.decoding.generator import Generator
from longspec.decoding.prefill import ChunkedPrefill
from longspec.decoding.proposers import LongSpecProposer, PromptLookup
from longspec.decoding.tree import TreeSpec
from longspec.models.draft import DraftConfig, init_draft


@pytest.fixture(scope="module")
def target(tiny_model_factory):
    return load_target(tiny_model_factory("prefill", "qwen3", max_position_embeddings=256, seed=4)[1])


@pytest.mark.parametrize("length", [1, 15, 16, 17, 50])
def test_chunks_write_the_eager_prefills_cache_and_logits(target, length):
    prompt = torch.randint(0, 160, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    eager = target.new_cache(2, 96)
    ref = target.prefill(torch.tensor([prompt]), torch.tensor([length]), eager.rows(1, 2))
    chunked_cache = target.new_cache(2, 96)
    chunked = ChunkedPrefill(target, chunked_cache, 16, None, cuda_graphs=False)
    assert chunked.fits(length)
    logits = chunked(1, prompt)
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
    assert chunked_cache.lengths.tolist() == [0, length] and chunked_cache.pending == 0
    torch.testing.assert_close(chunked_cache.k[:, 1, :, :length], eager.k[:, 1, :, :length], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked_cache.v[:, 1, :, :length], eager.v[:, 1, :, :length], atol=1e-5, rtol=1e-5)


def test_a_prompt_whose_last_chunk_does_not_fit_is_prefilled_eagerly(target):
    chunked = ChunkedPrefill(target, target.new_cache(1, 40), 16, None, cuda_graphs=False)
    assert chunked.fits(32) and not chunked.fits(33)  # 33 tokens: a third chunk padded to slot 48
    for chunk in (0, 41):  # a chunk longer than the cache would write past its slots
        with pytest.raises(ValueError, match="1 to 40 tokens"):
            ChunkedPrefill(target, target.new_cache(1, 40), chunk, None, cuda_graphs=False)


@pytest.mark.parametrize("proposer", ["none", "hybrid"])
def test_an_engine_prefilling_in_chunks_gives_the_same_tokens(target, proposer, monkeypatch):
    from test_speculative import run_joining

    prompts = [torch.randint(0, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (9, 40, 16, 33, 70)]
    budgets = [8, 12, 6, 10, 7]
    alone = [Generator(target).generate([p], GenerationConfig(max_new_tokens=n, ignore_eos=True)).sequences[0]
             for p, n in zip(prompts, budgets)]
    draft = init_draft(DraftConfig.for_target(target, window=8), target, seed=2)
    make = {"none": lambda: None, "hybrid": lambda: LongSpecProposer(draft, PromptLookup())}[proposer]
    tree = None if proposer == "none" else TreeSpec.parse("2,3,3")
    engine = Engine(target, make(), tree, max_batch=3, max_len=100, prefill_chunk=16)
    monkeypatch.setattr(target, "prefill", lambda *a, **k: pytest.fail("an eager prefill ran"))
    engine.warm_up()  # every row's chunk step prepared on idle rows
    assert not engine.cache.lengths.any()
    seqs = [Sequence(p, n) for p, n in zip(prompts, budgets)]
    run_joining(engine, seqs)
    assert [s.tokens for s in seqs] == alone
    assert set(engine.chunked_prefill.runners) == {0, 1, 2}


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
    monkeypatch.setattr(ChunkedPrefill, "__call__", lambda self, row, p: chunked.append(row) or call(self, row, p))
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


@pytest.mark.parametrize("impl", ["sdpa", "triton"])
def test_chunks_told_their_mask_is_causal_write_the_same(target, impl):
    """``causal_kernel``: the chunk's mask passed as causal (the Triton kernel computes it and
    skips blocks; on a CPU in its interpreter) -> the eager prefill's K/V and logits."""
    from longspec.attention import triton_kernels

    if impl == "triton" and not triton_kernels.available():
        pytest.skip("needs triton")
    prompt = torch.randint(0, 160, (37,), generator=torch.Generator().manual_seed(37)).tolist()
    eager = target.new_cache(1, 96)
    ref = target.prefill(torch.tensor([prompt]), torch.tensor([37]), eager)
    target.attention_impl = impl
    try:
        cache = target.new_cache(1, 96)
        logits = ChunkedPrefill(target, cache, 16, 96, cuda_graphs=False, causal_kernel=True)(0, prompt)
    finally:
        target.attention_impl = "sdpa"
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cache.k[:, 0, :, :37], eager.k[:, 0, :, :37], atol=1e-5, rtol=1e-5)
