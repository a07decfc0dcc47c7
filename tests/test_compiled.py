"""Compiled steps (``TargetModel.compile_steps``, the CUDA default) against the uncompiled ones on
the CPU, through Dynamo + AOTAutograd without Inductor's C++ code generation (``aot_eager``):
what the tracing may change (graph breaks around the in-place cache writes and the Triton
kernels, the proposal and accept glue traced whole, guards across layers and engines) must not
change a logit or a token. The GPU tests run the same engine with Inductor."""
import pytest
import torch

from longspec import GenerationConfig, load_target
from longspec.decoding.generator import Generator
from longspec.spec.proposers import LongSpecProposer, PromptLookup
from longspec.models import compiled as compiled_module
from longspec.models.draft import DraftConfig, init_draft


@pytest.fixture
def compiled_backend(monkeypatch):
    import torch._dynamo

    monkeypatch.setenv("LONGSPEC_COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(compiled_module, "_COMPILED", {})
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return tiny_model_factory("compiled", "llama", num_hidden_layers=3, max_position_embeddings=256, seed=3)


@pytest.mark.parametrize("impl", ["matmul", "sdpa", "triton"])
def test_compiled_layers_match_uncompiled(tiny, compiled_backend, impl):
    """Fixed-shape decode and verify steps (n_keys given) with compiled layers: same logits and
    the same cache contents; one compiled graph serves all layers (no recompilation per layer)."""
    import torch._dynamo

    target = load_target(tiny[1])
    target.attention_impl = impl
    results = []
    for compiled in (False, True):
        target.compile_steps = compiled
        gen = torch.Generator().manual_seed(0)
        cache = target.new_cache(2, 128)
        target.prefill(torch.randint(0, 160, (2, 40), generator=gen), torch.tensor([40, 33]), cache)
        first = target.decode(torch.tensor([3, 5]), cache, n_keys=128)
        mask = torch.ones(7, 7, dtype=torch.bool).tril()[None]
        positions = cache.lengths[:, None] + torch.arange(7)
        tree = target.verify(torch.randint(0, 160, (2, 7), generator=gen), positions, mask, cache, n_keys=128)
        cache.discard()
        again = target.decode(torch.tensor([4, 6]), cache, n_keys=128)
        results.append((first, tree, again, cache.k.clone(), cache.v.clone(), cache.lengths.clone()))
    for ours, ref in zip(*results):
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    frames = torch._dynamo.utils.counters["frames"]
    assert frames["ok"] > 0  # something was compiled
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # at most 4 pieces of a layer (split at the cache write and the Triton kernel, with their resume
    # frames) and one of the step's inputs per step shape (decode, verify): not per layer, which
    # would triple it here
    assert graphs <= (4 + 1) * 2


# the hybrid (the draft and prompt lookup together) in the default run; each alone, and plain
# decoding, in the slow one (each compiles afresh: 40-60 s here)
@pytest.mark.parametrize("proposer", ["hybrid", *(pytest.param(p, marks=pytest.mark.slow)
                                                  for p in ("none", "lookup", "draft"))])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_compiled_engine_same_tokens(tiny, compiled_backend, temperature, proposer):
    """Compiled proposal and accept glue: the same tokens (greedy, and sampling with a seed)
    compiled and uncompiled, on rows of different lengths."""
    target = load_target(tiny[1])
    draft = init_draft(DraftConfig.for_target(target, window=16), target)
    draft.limit_vocab(range(0, 160, 2))
    draft.fuse_projections()
    prompts = [torch.randint(0, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 20)]
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True, temperature=temperature, seed=5)
    make = {"none": lambda: None, "lookup": PromptLookup, "draft": lambda: LongSpecProposer(draft),
            "hybrid": lambda: LongSpecProposer(draft, PromptLookup())}[proposer]
    outs = []
    for compiled in (False, True):
        target.compile_steps = compiled
        outs.append(Generator(target, make(), tree="3,3,3" if proposer != "none" else None).generate(prompts, config))
    assert outs[1].sequences == outs[0].sequences


def test_the_triton_attention_is_no_graph_break_of_a_compiled_round(tiny, compiled_backend):
    """Compiled rounds of the hybrid (target steps and proposals) call the Triton attention
    kernels as operators (``attention/ops.py``): no more graphs than with PyTorch's attention (each
    kernel call used to split its graph), and the same tokens as uncompiled rounds."""
    import torch._dynamo

    from longspec.attention import triton_kernels
    from longspec.engine.engine import Engine, Sequence
    from longspec.spec.tree import TreeSpec

    if not triton_kernels.available():
        pytest.skip("needs triton")
    target = load_target(tiny[1])
    draft = init_draft(DraftConfig.for_target(target, window=16), target, seed=1)
    prompts = [torch.randint(0, 160, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 20)]
    graphs, tokens = {}, {}
    for impl, compiled in (("triton", False), ("sdpa", True), ("triton", True)):
        target.attention_impl, target.compile_steps = impl, compiled
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        engine = Engine(target, LongSpecProposer(draft, PromptLookup()), TreeSpec.parse("3,3,1"), max_batch=2,
                        max_len=128, compile_proposals=compiled, cuda_graphs=False)
        seqs = [Sequence(p, 6) for p in prompts]
        engine.add(seqs)
        while engine.has_active:
            engine.step()
        graphs[impl, compiled] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        tokens[impl, compiled] = [s.tokens for s in seqs]
    target.attention_impl, target.compile_steps = "sdpa", False
    assert tokens["triton", True] == tokens["triton", False]
    assert 0 < graphs["triton", True] <= graphs["sdpa", True], graphs


def test_a_failing_compiler_falls_back_to_uncompiled_steps(tiny, monkeypatch):
    """Where compilation fails (no Triton for Inductor, a compiler bug), every step still runs,
    once, uncompiled: the same tokens."""
    import torch._dynamo
    from torch._dynamo import register_backend

    @register_backend
    def longspec_test_failing(gm, example_inputs):
        raise RuntimeError("this machine has no compiler")

    monkeypatch.setenv("LONGSPEC_COMPILE_BACKEND", "longspec_test_failing")
    monkeypatch.setattr(compiled_module, "_COMPILED", {})
    torch._dynamo.reset()
    target = load_target(tiny[1])
    draft = init_draft(DraftConfig.for_target(target, window=16), target)
    prompts = [list(range(5, 45)), list(range(60, 80))]
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    outs = []
    for compiled in (False, True):
        target.compile_steps = compiled
        outs.append(Generator(target, LongSpecProposer(draft, PromptLookup()), tree="3,3").generate(prompts, config))
    assert outs[1].sequences == outs[0].sequences
    torch._dynamo.reset()


def test_compile_counts_count_the_graphs_compiled(tiny, compiled_backend):
    """``compile_counts``: the graphs compiled so far (what ``Engine.warm_up_graphs`` records per
    part and ``longspec serve`` prints after its warm-up): a compiled engine's first rounds add
    graphs, the same rounds again none."""
    from longspec.cli.serve_command import _graphs
    from longspec.engine.engine import Engine, Sequence
    from longspec.spec.tree import TreeSpec
    from longspec.models.compiled import compile_counts

    target = load_target(tiny[1])
    target.compile_steps = True
    try:
        draft = init_draft(DraftConfig.for_target(target, window=16), target, seed=1)
        engine = Engine(target, LongSpecProposer(draft), TreeSpec.parse("2,2"), max_batch=2, max_len=128,
                        compile_proposals=True, cuda_graphs=False)
        counts = [compile_counts()]
        for _ in range(2):
            engine.add([Sequence(list(range(10, 40)), 4)])
            while engine.has_active:
                engine.step()
            counts.append(compile_counts())
        engine.warm_up()  # (on a CPU nothing is captured: no part compiles)
    finally:
        target.compile_steps = False
    assert counts[1]["graphs"] > counts[0]["graphs"] and counts[2] == counts[1], counts
    assert list(engine.warm_up_graphs) == list(engine.warm_up_seconds)
    assert all(_graphs(c) == "" for c in engine.warm_up_graphs.values())
    line = _graphs({"graphs": 59, "loaded": 33, "traced": 26, "compiled": 0})
    assert line == " (59 graphs: 33 loaded whole from the compile cache, 26 traced again, 0 compiled by Inductor)"


def test_a_step_that_cannot_compile_runs_uncompiled_with_a_one_line_warning(monkeypatch):
    """When the compiler fails on a step, the step runs eagerly with the same result, and the user
    sees one line saying so, not Dynamo's two tracebacks; ``LONGSPEC_COMPILE_VERBOSE=1`` keeps them."""
    import logging

    import torch._dynamo
    from torch._dynamo import register_backend

    from longspec.models.compiled import compile_step

    def failing(gm, example_inputs):
        raise RuntimeError("no kernel for this op\nsecond line of the compiler's message")

    if "longspec_test_failing_op" not in torch._dynamo.list_backends(exclude_tags=()):
        register_backend(failing, name="longspec_test_failing_op")

    monkeypatch.setenv("LONGSPEC_COMPILE_BACKEND", "longspec_test_failing_op")
    x = torch.arange(6.0)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("torch._dynamo.convert_frame")
    logger.addHandler(handler)
    from longspec.compile_boundary import ShortCompileFailures, shorten_compile_failures

    shorten_compile_failures()
    for f in logger.filters:  # (failures reported before in this process are not repeated)
        if isinstance(f, ShortCompileFailures):
            f.seen.clear()
    try:
        _fail_twice(compile_step, x, records, monkeypatch)
    finally:
        logger.removeHandler(handler)
        torch._dynamo.reset()


def _fail_twice(compile_step, x, records, monkeypatch) -> None:
    """A failing step compiled and run twice, quiet then verbose; ``records``: what was logged."""
    import logging

    import torch._dynamo

    for verbose in ("0", "1"):
        monkeypatch.setenv("LONGSPEC_COMPILE_VERBOSE", verbose)
        torch._dynamo.reset()
        records.clear()

        def double_plus_one(t):
            return t * 2 + 1

        step = compile_step(double_plus_one)
        assert torch.equal(step(x), x * 2 + 1) and torch.equal(step(x), x * 2 + 1)
        text = "\n".join(logging.Formatter().format(r) for r in records)
        if verbose == "0":
            assert len(text.splitlines()) == 1, text
            assert "double_plus_one" in text and "RuntimeError: no kernel for this op" in text and "uncompiled" in text
        else:
            assert "WON'T CONVERT double_plus_one" in text and len(text.splitlines()) > 10, text
    # Inductor's dump of a node it cannot generate code for is left out too (verbose: kept)
    scheduler = logging.getLogger("torch._inductor.scheduler")
    for verbose, kept in (("0", False), ("1", True)):
        monkeypatch.setenv("LONGSPEC_COMPILE_VERBOSE", verbose)
        record = scheduler.makeRecord(scheduler.name, logging.CRITICAL, __file__, 1, "Error in codegen for %s",
                                      ("ComputedBuffer(...)",), None)
        assert bool(scheduler.filter(record)) is kept  # (Python 3.12: the record, or False)


def test_a_large_vocabularys_sampled_argmax_runs_apart_with_the_same_result(compiled_backend):
    """Above ``LARGE_VOCAB`` columns the sampled rounds' greedy argmax is a graph break (Inductor
    cannot fuse it with the softmax there): a compiled warp gives the eager warp's probabilities
    either way, as two graphs for a large vocabulary and one for a small one."""
    import torch._dynamo

    from longspec.spec.sampling import LARGE_VOCAB, warp_probs_rows
    from longspec.models.compiled import compile_step

    temperature = torch.tensor([0.0, 0.7])
    graphs = {}
    for vocab in (1000, LARGE_VOCAB + 8):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        logits = torch.randn(2, 3, vocab, generator=torch.Generator().manual_seed(vocab))
        logits[0, 1, 5] = logits[0, 1, 9] = logits[0, 1].max() + 1  # a tie: the first index wins
        warp = compile_step(lambda x, t: warp_probs_rows(x, t, None, None))
        assert torch.equal(warp(logits, temperature), warp_probs_rows(logits, temperature, None, None))
        assert warp(logits, temperature)[0, 1].argmax() == 5
        graphs[vocab] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs[1000] == 1 and graphs[LARGE_VOCAB + 8] == 2, graphs
