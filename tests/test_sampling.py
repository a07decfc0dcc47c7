"""warp_probs / sample: HF-equivalence of the warper chain, greedy, validation."""
import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from longspec.spec.sampling import sample, warp_logits, warp_probs


def hf_probs(logits, temperature, top_k, top_p):
    procs = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    return procs(None, logits.float().clone()).softmax(-1)


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 5, 1.0), (0.5, 10, 0.8), (2.0, 3, 0.5), (0.9, 50, 0.95), (1.0, 1, 1.0)],
)
@pytest.mark.parametrize("ties", [False, True])
def test_warp_probs_matches_hf(temperature, top_k, top_p, ties):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 40, generator=g) * 3
    if ties:  # coarse values: many exact ties around the top-k / top-p thresholds
        logits = logits.round()
    ours = warp_probs(logits, temperature, top_k, top_p)
    ref = hf_probs(logits, temperature, top_k, top_p)
    assert ours.dtype == torch.float32
    assert torch.equal(ours == 0, ref == 0)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)
    # works on [..., V] too
    torch.testing.assert_close(warp_probs(logits.view(4, 4, 40), temperature, top_k, top_p), ours.view(4, 4, 40))


def test_off_values_and_half_input():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    base = warp_probs(logits, 0.8)
    for k, p in [(None, None), (0, 1.0), (20, 1.0), (100, None)]:
        torch.testing.assert_close(warp_probs(logits, 0.8, k, p), base)
    torch.testing.assert_close(base, (logits / 0.8).softmax(-1))
    half = warp_probs(logits.half(), 0.8, 5, 0.9)
    assert half.dtype == torch.float32
    assert torch.isneginf(warp_logits(logits, 1.0, top_k=3)).sum(-1).eq(17).all()


def test_greedy_is_one_hot_argmax():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, -1.0, 0.0, 0.0]])
    probs = warp_probs(logits, 0.0, top_k=2, top_p=0.5)
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=1.0, top_k=-1), "top_k"),
        (dict(temperature=1.0, top_k=2.5), "top_k"),
        (dict(temperature=1.0, top_p=0.0), "top_p"),
        (dict(temperature=1.0, top_p=1.5), "top_p"),
    ],
)
def test_invalid_args(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        warp_probs(torch.zeros(2, 5), **kwargs)


def test_sample_shapes_and_determinism():
    probs = warp_probs(torch.randn(6, 9, generator=torch.Generator().manual_seed(2)), 1.0, 3)
    a = sample(probs, torch.Generator().manual_seed(5))
    b = sample(probs, torch.Generator().manual_seed(5))
    assert a.shape == (6,) and a.dtype == torch.long and torch.equal(a, b)
    assert (probs.gather(1, a[:, None]) > 0).all()
    assert sample(probs.view(2, 3, 9)).shape == (2, 3)
    # frequencies
    p = torch.tensor([[0.1, 0.6, 0.3]]).expand(60000, 3)
    freq = torch.bincount(sample(p, torch.Generator().manual_seed(0)), minlength=3) / 60000
    torch.testing.assert_close(freq, torch.tensor([0.1, 0.6, 0.3]), atol=0.01, rtol=0)


def test_per_row_warping_equals_scalar_warping():
    from longspec.spec.sampling import warp_probs_rows

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 3, 50, generator=gen) * 3
    settings = [(0.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 5, 1.0), (1.0, 7, 0.8), (0.5, 50, 0.5)]
    t = torch.tensor([s[0] for s in settings])
    k = torch.tensor([s[1] for s in settings])
    p = torch.tensor([s[2] for s in settings])
    rows = warp_probs_rows(logits, t, k, p)
    for i, (ti, ki, pi) in enumerate(settings):
        assert torch.allclose(rows[i], warp_probs(logits[i], ti, ki, pi), atol=1e-6), settings[i]


def test_per_row_warping_without_top_k_and_top_p_skips_them_with_the_same_result():
    """top_k / top_p None (no row uses them): the same distributions as with them off (0 / 1.0),
    greedy rows still one-hot."""
    from longspec.spec.sampling import warp_probs_rows

    logits = torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(1)) * 3
    t = torch.tensor([0.0, 0.7, 1.3])
    off = warp_probs_rows(logits, t, torch.zeros(3, dtype=torch.long), torch.ones(3))
    assert torch.equal(warp_probs_rows(logits, t, None, None), off)
    assert torch.equal(off[0], torch.nn.functional.one_hot(logits[0].argmax(-1), 50).float())




def test_top_p_over_a_whole_vocabulary_with_p_near_one_keeps_the_exact_nucleus():
    """At 49,152 tokens and p up to 0.9999 a float32 cumulative sum of the ascending tail is a few
    of its last bits off where it adds large to small; the sorting path keeps the exact (float64)
    nucleus."""
    from longspec.spec import sampling

    logits = torch.randn(4, 49152, generator=torch.Generator().manual_seed(7)) * 3
    k, p = torch.zeros(4, 1, dtype=torch.long), torch.tensor([[0.9], [0.99], [0.999], [0.9999]])
    probs = logits.double().softmax(-1).sort(-1, descending=True).values
    exact = ((probs.cumsum(-1) - probs) < p.double()).sum(-1)  # kept: the mass above below p
    assert torch.equal(sampling._truncate_sorting(logits, k, p).isfinite().sum(-1), exact)


def test_top_p_keeps_the_top_token_however_small_p():
    from longspec.spec import sampling

    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(2))
    k, p = torch.zeros(2, 1, dtype=torch.long), torch.tensor([[1e-45], [1e-30]])
    kept = sampling._truncate_sorting(logits, k, p).isfinite()
    assert (kept.sum(-1) == 1).all() and torch.equal(kept.float().argmax(-1), logits.argmax(-1))
