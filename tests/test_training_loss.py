"""Draft training loss: alignment of the lagged targets, distillation, and the chunked LM-head loss
against full logits (sums and gradient), eager and compiled by Inductor."""
import shutil

import pytest
import torch

from longspec.training import head_loss_sums, loss_sums


def test_loss_alignment():
    ids = torch.randint(0, 7, (2, 10), generator=torch.Generator().manual_seed(1))
    perfect = torch.full((2, 10, 7), -30.0)
    perfect[:, :-1].scatter_(2, ids[:, 1:, None], 30.0)  # position t puts all mass on token t + 1
    for lag in (1, 3):
        s = loss_sums(perfect, ids, lag)
        assert s.count == 2 * (10 - 1 - lag) and int(s.correct) == s.count and float(s.ce) < 1e-6
    s = loss_sums(torch.zeros(2, 10, 7), ids, 2, target_logits=perfect, distill_weight=0.5)
    assert float(s.kl) > 0 and float(s.objective) == pytest.approx(0.5 * float(s.ce) + 0.5 * float(s.kl))


@pytest.mark.parametrize("distill", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_chunked_head_loss_matches_full_logits(distill, chunk):
    """The chunked LM-head loss (never more than ``chunk`` rows of logits) gives the reference's
    sums and the same gradient with respect to the draft's hidden states."""
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 12, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 8, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, 11, (2, 12), generator=gen)
    target_hidden = torch.randn(2, 12, 8, generator=gen, dtype=torch.float64) if distill else None
    lag, w = 2, 0.3
    ref = loss_sums(hidden @ weight.T, ids, lag, None if target_hidden is None else target_hidden @ weight.T, w)
    (ref_grad,) = torch.autograd.grad(ref.objective, hidden)
    ours = head_loss_sums(hidden, weight, ids, lag, target_hidden, w, chunk=chunk)
    (our_grad,) = torch.autograd.grad(2.5 * ours.objective, hidden)
    for a, b in ((ours.objective, ref.objective), (ours.ce, ref.ce), (ours.kl, ref.kl)):
        assert float(a) == pytest.approx(float(b), rel=1e-5, abs=1e-6)
    assert int(ours.correct) == int(ref.correct) and ours.count == ref.count
    torch.testing.assert_close(our_grad, 2.5 * ref_grad, atol=1e-5, rtol=1e-4)  # logits in float32


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("clang++")), reason="Inductor on a CPU needs a C++ compiler")
@pytest.mark.parametrize("distill", [False, True])
def test_chunked_head_loss_compiled_by_inductor_is_the_same(distill):
    """``--compile`` puts each loss chunk's elementwise work through Inductor: the same sums and
    gradient as eager (Inductor once dropped the one-hot term of a scatter_add fused next to the
    KL's reduction: now a comparison)."""
    from torch._dynamo.utils import counters

    from longspec.models.compiled import compile_step
    from longspec.training.loss import _chunk_terms

    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(3, 20, 16, generator=gen, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen)
    ids = torch.randint(0, 50, (3, 20), generator=gen)
    target_hidden = torch.randn(3, 20, 16, generator=gen) if distill else None
    before = counters["stats"]["unique_graphs"]
    results = []
    for terms in (_chunk_terms, compile_step(_chunk_terms)):
        sums = head_loss_sums(hidden, weight, ids, 1, target_hidden, 0.4, chunk=16, terms=terms)
        (grad,) = torch.autograd.grad(sums.objective, hidden)
        results.append((sums, grad))
    assert counters["stats"]["unique_graphs"] > before  # it did compile
    (eager, eager_grad), (compiled, compiled_grad) = results
    for a, b in ((eager.ce, compiled.ce), (eager.kl, compiled.kl), (eager.objective, compiled.objective)):
        assert float(a) == pytest.approx(float(b), rel=1e-5)
    assert int(eager.correct) == int(compiled.correct)
    torch.testing.assert_close(compiled_grad, eager_grad, atol=1e-6, rtol=1e-5)
