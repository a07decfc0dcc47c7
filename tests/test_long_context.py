"""Correctness at size (``-m gpu``): the Triton kernels over caches past 2^31 elements (three
rows of 1M slots, 64-bit offsets) against the float32 reference on every row, and greedy
speculative decoding == autoregressive decoding after a 256k-token prompt (a tiny float32 target,
a random draft). About a minute on an H200."""
import pytest
import torch

from longspec import load_target
from longspec.attention import reference, triton_kernels
from longspec.engine.engine import Engine, Sequence
from longspec.spec.proposers import LongSpecProposer
from longspec.spec.tree import TreeSpec
from longspec.models.draft import DraftConfig, init_draft

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SLOTS = 1 << 20  # per row: row 2 of [3, 8, SLOTS, 128] starts at element 2^31


def row_reference(q, k_row, v_row, length, mask):
    """The float32 hybrid attention of one row: q [1, Hq, M, D]; k_row, v_row [1, Hkv, >= length + M, D]."""
    m = q.shape[2]
    k, v = k_row[:, :, :length + m].float(), v_row[:, :, :length + m].float()
    lens = torch.tensor([length], device=q.device)
    return reference.hybrid_attention(q.float(), k, v, lens, k[:, :, length:], v[:, :, length:], mask)


def relative_error(ours, ref) -> float:
    return float((ours.float() - ref).norm() / ref.norm())


@pytest.mark.parametrize("layout", ["dense", "pool"])
def test_kernels_past_2_31_cache_elements_match_the_float32_reference(layout):
    """Rows [3, Hkv 8, 1M slots, D 128] bf16 (3.2e9 elements; as one pool layer [8, 3M + 256, 128]
    read through a shuffled block table, head offsets past 2^31): the tree kernel (prefix + tree
    part) and the per-query-limit prefix kernel == the float32 reference, row by row."""
    torch.manual_seed(0)
    b, hq, hkv, m, d, bs = 3, 32, 8, 8, 128, 256
    lengths = torch.tensor([SLOTS - 64, 300_000, SLOTS - m], device="cuda")
    q = torch.randn(b, hq, m, d, device="cuda", dtype=torch.bfloat16)
    mask = (torch.rand(b, m, m, device="cuda") < 0.5) | torch.eye(m, dtype=torch.bool, device="cuda")
    limits = torch.stack([torch.randint(0, int(n) + 1, (m,), device="cuda") for n in lengths])
    if layout == "dense":
        k = torch.randn(b, hkv, SLOTS, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        assert k.numel() > 2**31
        table, rows = None, [(k[i:i + 1], v[i:i + 1]) for i in range(b)]
    else:
        per_row = SLOTS // bs
        table = torch.randperm(b * per_row, device="cuda").view(b, per_row)
        k = torch.randn(hkv, (b * per_row + 1) * bs, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        assert k.numel() > 2**31

        def gathered(store, i):  # row i's slots 0..SLOTS-1 as [1, Hkv, SLOTS, D] (a copy)
            slots = (table[i][:, None] * bs + torch.arange(bs, device="cuda")).view(-1)
            return store[:, slots][None]

        rows = [(gathered(k, i), gathered(v, i)) for i in range(b)]
    tree = triton_kernels.tree_attention(q, k, v, lengths, mask, table=table, block_size=bs if table is not None else 0)
    prefix = triton_kernels.prefix_attention(q, k, v, limits, table=table, block_size=bs if table is not None else 0)
    for i, (k_row, v_row) in enumerate(rows):
        n = int(lengths[i])
        ref = row_reference(q[i:i + 1], k_row, v_row, n, mask[i:i + 1])
        assert relative_error(tree[i:i + 1], ref) < 2e-2, f"tree kernel, row {i}"
        ref, _ = reference.prefix_attention(q[i:i + 1].float(), k_row.float(), v_row.float(), limits[i:i + 1])
        assert relative_error(prefix[i:i + 1], ref) < 2e-2, f"prefix kernel, row {i}"


def test_greedy_speculative_equals_autoregressive_after_256k_tokens(tiny_model_factory):
    """A tiny float32 target (Triton kernels, CUDA graphs), a 262,200-token prompt prefilled
    layer by layer (the path of every prompt of ``by_layer_from`` tokens or more): greedy speculative tokens (random draft, beam tree) == plain decoding's."""
    path = tiny_model_factory("long-context", "llama", max_position_embeddings=1 << 19, seed=11)[1]
    target = load_target(path, dtype=torch.float32, device="cuda")
    target.compile_steps = False  # (compilation is tested elsewhere; it would only add minutes here)
    prompt = torch.randint(0, 160, (262_200,), generator=torch.Generator().manual_seed(5)).tolist()
    draft = init_draft(DraftConfig.for_target(target, window=64), target, seed=3)
    outputs = []
    for proposer, tree in ((None, None), (LongSpecProposer(draft), TreeSpec.parse("3,4,4,4"))):
        engine = Engine(target, proposer, tree, max_len=len(prompt) + 8192, prefill_chunk=8192)
        assert engine.chunked_prefill.takes([len(prompt)], [0]) and engine.chunked_prefill.by_layer(len(prompt))
        seq = Sequence(prompt, 40)
        engine.add([seq])
        assert not engine.chunked_prefill.runners  # (no chunk step ran)
        while engine.has_active:
            engine.step()
        outputs.append(seq.tokens)
        engine.close()
    assert len(outputs[0]) == 40 and outputs[1] == outputs[0]
