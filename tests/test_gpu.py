"""CUDA checks (``-m gpu``): the same engine on the GPU — parity with transformers, CUDA-graph
rounds equal to eager rounds, greedy losslessness in float32 (and a bfloat16 run), sampling
against the exact distribution, and at most one host synchronisation per round."""
import itertools
import warnings

import pytest
import torch

from conftest import hf_logits
from longspec import GenerationConfig, load_target
from longspec.engine.engine import Engine, Sequence
from longspec.decoding.generator import Generator
from longspec.spec.proposers import LongSpecProposer, PromptLookup
from longspec.spec.streaming import StreamingSelfSpec
from longspec.spec.tree import TreeSpec
from longspec.models.draft import DraftConfig, init_draft

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(autouse=True)
def own_home(tmp_path, monkeypatch):
    """Each test its own longspec home: what auto measured and learned in one test (step costs,
    corrections of its predictions, kept per model and draft) does not steer the next."""
    monkeypatch.setenv("LONGSPEC_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return tiny_model_factory("gpu-llama", "llama", max_position_embeddings=512, seed=7)


def cuda_target(path, dtype, compiled: bool = False):
    """The target on CUDA with uncompiled steps (compilation has its own test below; compiling
    every shape of every test would make this file take many minutes)."""
    target = load_target(path, dtype=dtype, device="cuda")
    target.compile_steps = compiled
    return target


def test_cuda_parity_float32(model):
    hf, path = model
    target = cuda_target(path, torch.float32)
    ids = torch.randint(0, 160, (1, 100))
    cache = target.new_cache(1, 128)
    ours = target.prefill(ids.cuda(), torch.tensor([100]), cache, chunk_size=32, all_logits=True)
    assert (ours[0].cpu() - hf_logits(hf, ids[0])).abs().max() < 1e-4


def proposers(target):
    draft = init_draft(DraftConfig.for_target(target, window=16), target)
    return [(None, None), (PromptLookup(), "chain:4"), (StreamingSelfSpec(window=16), "3,4,4"),
            (LongSpecProposer(draft), "4,16,16,16,16"), (LongSpecProposer(draft), "chain:5"),
            (LongSpecProposer(draft), '[[0],[1],[0,0],[0,1],[0,0,0]]')]


@pytest.mark.parametrize("impl", ["sdpa", "matmul", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_speculative_lossless_and_graphs_equal_eager(model, dtype, impl):
    _, path = model
    target = cuda_target(path, dtype)
    target.attention_impl = impl
    prompts = [torch.randint(0, 160, (n,)).tolist() for n in (20, 45, 31)]
    config = GenerationConfig(max_new_tokens=32, ignore_eos=True)
    expected = Generator(target, cuda_graphs=False).generate(prompts, config).sequences
    assert Generator(target, cuda_graphs=True).generate(prompts, config).sequences == expected
    for proposer, tree in proposers(target)[1:]:
        eager = Generator(target, proposer=proposer, tree=TreeSpec.parse(tree), cuda_graphs=False)
        graphed = Generator(target, proposer=proposer, tree=TreeSpec.parse(tree))
        out = graphed.generate(prompts, config)
        assert out.stats["cuda_graphs"] == proposer.graphable
        assert out.sequences == eager.generate(prompts, config).sequences, (tree, "graph != eager")
        assert graphed.generate(prompts, config).sequences == out.sequences  # graphs replayed again
        if dtype == torch.float32:
            assert out.sequences == expected, tree
        else:  # bf16: tree and one-token forwards may round differently; most tokens must agree
            agree = sum(a == b for x, y in zip(out.sequences, expected) for a, b in zip(x, y))
            assert agree >= 0.5 * sum(map(len, expected))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_generation_on_a_second_gpu_while_the_first_is_current(model):
    """``self-distill --device cuda:1`` on a two-GPU host: graphs, round timing events and output
    as on cuda:0 (the events were once recorded on cuda:0's stream and read before they ended)."""
    _, path = model
    prompts = [torch.randint(0, 160, (n,)).tolist() for n in (20, 45)]
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    outs = []
    for device in ("cuda:0", "cuda:1"):
        target = load_target(path, dtype=torch.float32, device=device)
        target.compile_steps = False
        draft = init_draft(DraftConfig.for_target(target, window=16), target)
        out = Generator(target, proposer=LongSpecProposer(draft), tree=TreeSpec.parse("3,4,4")).generate(prompts, config)
        assert out.stats["cuda_graphs"]
        outs.append(out.sequences)
    assert torch.cuda.current_device() == 0 and outs[1] == outs[0]


@pytest.mark.parametrize("impl", ["matmul", "triton"])
def test_compiled_steps_equal_uncompiled(model, impl):
    """torch.compile'd layers, proposal and accept glue (float32): the same tokens as the uncompiled
    engine and as autoregressive decoding, for decode, a beam tree, a chain and prompt lookup."""
    _, path = model
    target = load_target(path, dtype=torch.float32, device="cuda")
    assert target.compile_steps and target.attention_impl == "triton"  # the CUDA defaults
    target.attention_impl = impl
    prompts = [torch.randint(0, 160, (n,)).tolist() for n in (20, 45, 31)]
    config = GenerationConfig(max_new_tokens=32, ignore_eos=True)
    draft = init_draft(DraftConfig.for_target(target, window=16), target)
    cases = [(None, None), (LongSpecProposer(draft), "4,16,16,16,16"), (LongSpecProposer(draft), "chain:5"),
             (PromptLookup(), "chain:4")]
    expected = None
    for proposer, tree in cases:
        outs = []
        for compiled in (False, True):
            target.compile_steps = compiled
            outs.append(Generator(target, proposer=proposer, tree=tree).generate(prompts, config).sequences)
        assert outs[1] == outs[0], (tree, "compiled != uncompiled")
        expected = expected or outs[0]
        assert outs[0] == expected, tree


@pytest.mark.parametrize("tree", ["2,3", "chain:2"])
def test_sampling_with_graphs_matches_target_distribution(tiny_model_factory, tree):
    """20000 rows in one graph-captured batch (LongSpec draft, beam: point-mass rule; chain:
    residual rule); chi-square of the first two tokens against the exact warped target."""
    from test_speculative_sampling import assert_two_token_distribution

    _, path = tiny_model_factory("spec-v8", "llama", vocab_size=8, max_position_embeddings=128, seed=9)
    target = cuda_target(path, torch.float32)
    cpu_target = load_target(path)
    draft = init_draft(DraftConfig.for_target(target, window=4), target, seed=1)
    prompt, n = [1, 5, 2, 7, 3, 0, 6], 20000
    config = GenerationConfig(max_new_tokens=2, temperature=0.8, top_p=0.9, seed=123, ignore_eos=True)
    out = Generator(target, proposer=LongSpecProposer(draft), tree=tree).generate([prompt] * n, config)
    assert out.stats["cuda_graphs"]
    assert_two_token_distribution(cpu_target, prompt, config, out.sequences)


@pytest.mark.parametrize("spec", [None, "4,16,16,16,16"])
def test_one_host_sync_per_round(model, spec):
    _, path = model
    target = cuda_target(path, torch.bfloat16, compiled=True)  # the default steps: compiled
    draft = init_draft(DraftConfig.for_target(target, window=16), target)
    proposer = None if spec is None else LongSpecProposer(draft)
    engine = Engine(target, proposer, TreeSpec.parse(spec) if spec else None, max_batch=2, max_len=256)
    engine.add([Sequence(torch.randint(0, 160, (n,)).tolist(), 64) for n in (30, 50)])
    engine.step()  # captures the graphs
    torch.cuda.synchronize()
    rounds = 5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(rounds):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
    assert len(syncs) <= rounds, [str(w.message) for w in syncs]


@pytest.mark.parametrize("proposer", ["none", "pld", "hybrid", "hybrid, bucket 2 plain"])
def test_batch_buckets_with_graphs_equal_alone(model, proposer):
    """A serving engine (4 rows, buckets 1/2/4) with requests joining and leaving: each bucket's
    rounds are captured on first use, and every greedy output equals the request run alone (also
    with a bucket that decodes plainly between drafting ones)."""
    from test_speculative_engine import run_joining

    _, path = model
    target = cuda_target(path, torch.float32)
    draft = init_draft(DraftConfig.for_target(target, window=16), target, seed=3)
    plain = {2: "plain"} if proposer.endswith("plain") else None
    proposer = proposer.split(",")[0]
    make = {"none": lambda: None, "pld": PromptLookup, "hybrid": lambda: LongSpecProposer(draft, PromptLookup())}
    tree = None if proposer == "none" else TreeSpec.parse("2,3,3")
    prompts = [torch.randint(0, 160, (n,)).tolist() for n in (25, 60, 33, 41, 19)]
    budgets = [9, 30, 12, 20, 7]
    alone = [Generator(target, make[proposer](), tree).generate(
        [p], GenerationConfig(max_new_tokens=n, ignore_eos=True)).sequences[0] for p, n in zip(prompts, budgets)]
    engine = Engine(target, make[proposer](), tree, max_batch=4, max_len=128, bucket_trees=plain)
    if proposer == "hybrid":
        engine.warm_up()  # every bucket captured up front, on idle rows (as the server does)
        assert {key[-1] for key in engine.runners} == {1, 2, 4}
    seqs = [Sequence(p, n) for p, n in zip(prompts, budgets)]
    run_joining(engine, seqs)
    assert [s.tokens for s in seqs] == alone
    assert {key[-1] for key in engine.runners} == {1, 2, 4}
    assert all(r.graphs is not None for r in engine.runners.values())


def test_capture_survives_a_dead_graph_collected_during_it():
    """A dead object (a reference cycle) holding a CUDA graph, collected by Python while another
    graph is captured, resets its graph mid-capture, which invalidates the capture (seen as a
    failed capture and an illegal memory access on the H200). Captures collect garbage first and
    pause the collector; the phase below collects only while capturing, where an automatic
    collection could strike."""
    import gc

    from longspec.engine.runner import PhaseRunner
    from longspec.spec.sampling import Uniforms

    class Holder:
        pass

    def make_dead_cycle():
        holder = Holder()
        holder.me = holder
        holder.x = torch.zeros(4, device="cuda")
        holder.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(holder.graph):
            holder.x.add_(1)

    y = torch.zeros(4, device="cuda")

    def phase():
        if torch.cuda.is_current_stream_capturing():
            gc.collect()
        y.add_(1)

    make_dead_cycle()
    runner = PhaseRunner([phase], [y], Uniforms(None, "cuda"), torch.device("cuda"), cuda_graphs=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runner.run_round()
        runner.run_round()
    torch.cuda.synchronize()
    assert runner.graphs is not None
    assert y.tolist() == [2.0] * 4  # the two rounds (the capture's warm-up runs were undone)


def test_a_destroyed_graph_does_not_break_a_live_one():
    """Destroying a graph makes PyTorch free the cuBLAS workspace of its capture stream, which
    every capture shares (runner.capture_stream): a live graph that used that workspace must
    still replay correctly after other graphs were captured and destroyed and the cache emptied
    (a replay into freed memory would be an illegal memory access). Last in this file: a failure
    here poisons the CUDA context."""
    from longspec.engine.runner import PhaseRunner, time_graph
    from longspec.spec.sampling import Uniforms

    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)  # skinny: cuBLAS splits K (workspace)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    out = torch.zeros(8, 4096, device="cuda", dtype=torch.bfloat16)
    live = PhaseRunner([lambda: out.copy_(x @ w)], [], Uniforms(None, "cuda"), torch.device("cuda"), cuda_graphs=True)
    live.run_round()
    for _ in range(3):  # other graphs captured and destroyed (as auto's cost measurement does)
        time_graph(lambda: x @ w, 2)
    torch.cuda.empty_cache()
    out.zero_()
    live.run_round()
    torch.cuda.synchronize()
    assert live.graphs is not None
    torch.testing.assert_close(out, x @ w)


@pytest.mark.parametrize("chunk", [16, 64, (8, 16, 64)])
def test_chunked_prefill_with_graphs_equals_the_eager_prefill(model, chunk):
    """Prompts prefilled in graph-captured chunks (every row's chunk step of every size captured
    at warm-up; with a ladder, each prompt's rest in smaller chunks): the same greedy tokens as
    one eager prefill, rows joining between rounds."""
    from test_speculative_engine import run_joining

    _, path = model
    target = cuda_target(path, torch.float32)
    draft = init_draft(DraftConfig.for_target(target, window=16), target, seed=3)
    prompts = [torch.randint(0, 160, (n,)).tolist() for n in (25, 60, 33, 41, 19)]
    budgets = [9, 30, 12, 20, 7]
    make = lambda: LongSpecProposer(draft, PromptLookup())  # noqa: E731
    tree = TreeSpec.parse("2,3,3")
    alone = [Generator(target, make(), tree).generate([p], GenerationConfig(max_new_tokens=n, ignore_eos=True))
             .sequences[0] for p, n in zip(prompts, budgets)]
    engine = Engine(target, make(), tree, max_batch=4, max_len=192, prefill_chunk=chunk)
    engine.warm_up()
    chunked = engine.chunked_prefill
    assert len(chunked.runners) == len(chunked.sizes)  # one chunk step per size serves every row
    assert all(r.graphs is not None for r in chunked.runners.values())
    seqs = [Sequence(p, n) for p, n in zip(prompts, budgets)]
    run_joining(engine, seqs)
    assert [s.tokens for s in seqs] == alone
    assert len(chunked.runners) == len(chunked.sizes) and set(chunked.steps_run) == set(chunked.sizes)



def test_steady_state_compiles_and_captures_nothing(model):
    """After a warm-up (a greedy, a sampled and a top-k call per generator), 20 requests of varied prompt
    lengths, max_new_tokens and sampling settings, on engines that already have their trees,
    cause no Dynamo compilation and no CUDA-graph capture, and give plain decoding's tokens."""
    import torch._dynamo

    _, path = model
    target = load_target(path, dtype=torch.bfloat16, device="cuda")
    assert target.compile_steps and target.attention_impl == "triton"  # the CUDA defaults
    draft = init_draft(DraftConfig.for_target(target, window=16), target)
    plain = Generator(target)
    gens = [plain, Generator(target, LongSpecProposer(draft, PromptLookup()), "3,4,4,1,1"),
            Generator(target, PromptLookup(), "chain:4")]
    gen = torch.Generator().manual_seed(0)
    for g in gens:
        for temperature, top_k in ((0.0, 0), (0.8, 0), (0.8, 10)):
            g.generate([torch.randint(0, 160, (50,), generator=gen).tolist()],
                       GenerationConfig(max_new_tokens=8, temperature=temperature, top_k=top_k, seed=1))

    def graphs():
        return sum(len(r.graphs or []) for g in gens for r in g._engine.all_runners)

    frames, captured = dict(torch._dynamo.utils.counters["frames"]), graphs()
    for i in range(20):
        g = gens[i % 3]
        prompt = torch.randint(0, 160, (10 + 17 * i,), generator=gen).tolist()  # (at most 333 + 62 + tree)
        greedy = i % 2 == 0
        config = GenerationConfig(max_new_tokens=5 + 3 * i, temperature=0.0 if greedy else 0.9, top_k=20 * (i % 3),
                                  seed=i, ignore_eos=True)
        out = g.generate([prompt], config)
        assert out.stats["capture_s"] == 0.0, i
        if greedy and g is not plain:
            assert out.sequences == plain.generate([prompt], config).sequences, i
    assert dict(torch._dynamo.utils.counters["frames"]) == frames, "something was compiled in steady state"
    assert graphs() == captured


def test_auto_captures_every_choice_on_its_first_call(model, monkeypatch):
    """``--proposer auto`` with a draft on CUDA: its first call captures every tree it may pick
    (the hybrid's, its lookup's chain, plain rounds), so later calls, whichever they start with
    (each candidate in turn predicted fastest), capture nothing, and each gives plain decoding's
    tokens."""
    from longspec.decoding import auto, generator

    _, path = model
    target = cuda_target(path, torch.bfloat16)
    draft = init_draft(DraftConfig.for_target(target, window=16), target)
    draft.config.acceptance = [[0.3, 0.4, 0.45, 0.5, 0.6, 0.7]] * 6
    trees = auto.candidate_trees(draft)
    script = itertools.cycle([*trees, None])

    def resolve(target, ids, draft, costs_file=None):  # the script's tree predicted fastest
        first = next(script)
        predicted = {t: (1.0, 1.0) for t in [*trees, None]} | {first: (10.0, 1.0)}
        return auto.Plan("hybrid", trees[0], first, draft, "scripted", predicted)

    monkeypatch.setattr(generator, "resolve", resolve)
    gen, plain = Generator(target, "auto", draft=draft), Generator(target)
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    rng = torch.Generator().manual_seed(3)
    for i in range(2 * (len(trees) + 1)):
        prompt = torch.randint(0, 160, (30 + 11 * i,), generator=rng).tolist() * 2
        out = gen.generate([prompt], config)
        assert out.sequences == plain.generate([prompt], config).sequences, i
        if i > 0:
            assert out.stats["capture_s"] == 0.0, (i, len(prompt), out.stats.get("trees"), out.stats.get("auto"))
    # near the context's end no tree fits: plain rounds in a plain engine, whose first call captures them
    fresh = Generator(target, "auto", draft=init_draft(DraftConfig.for_target(target, window=16), target))
    fresh.draft.config.acceptance = draft.config.acceptance
    prompt = torch.randint(0, 160, (470,), generator=rng).tolist()
    out = fresh.generate([prompt], config)  # (470 + 24 new tokens: room for plain rounds, not for a tree)
    assert out.sequences == plain.generate([prompt], config).sequences and out.stats["auto"].startswith("the prompt")


def test_auto_goes_plain_mid_call_on_cuda(model, monkeypatch):
    """``--proposer auto`` on CUDA switching to plain rounds mid-call where they measure faster,
    greedy and sampled: a tree predicted fast (3 tokens a round in 0.5 ms) whose rounds accept
    about one token with a random draft gives way to plain rounds (timed then) and keeps them,
    and later calls go plain too (at once, or after a few rounds of the tree while its measured
    rounds still look faster); float32 greedy tokens equal plain decoding's,
    and a greedy call after the first captures nothing."""
    from longspec.decoding import auto, generator

    _, path = model
    target = cuda_target(path, torch.float32)
    draft = init_draft(DraftConfig.for_target(target, window=16), target)
    draft.config.acceptance = [[0.3, 0.4, 0.45, 0.5, 0.6, 0.7]] * 6
    tree = auto.candidate_trees(draft)[0]
    predicted = {tree: (3.0, 0.5), None: (1.0, 0.3)}
    monkeypatch.setattr(generator, "resolve", lambda *a, **k: auto.Plan("hybrid", tree, tree, draft, "scripted", predicted))
    gen, plain = Generator(target, "auto", draft=draft), Generator(target)
    rng = torch.Generator().manual_seed(6)
    for i, temperature in enumerate((0.0, 1.0, 0.0)):
        prompt = torch.randint(0, 160, (40 + 9 * i,), generator=rng).tolist() * 2
        config = GenerationConfig(max_new_tokens=40, temperature=temperature, seed=i, ignore_eos=True)
        out = gen.generate([prompt], config)
        trees = [t for _, t in out.stats["trees"]]  # (predicted 1.8x plain rounds: the tree first)
        # later calls start with the tree where its measured rounds still look faster, or plain
        assert trees == [str(tree), None] if i == 0 else trees in ([str(tree), None], [None]), trees
        assert len(out.sequences[0]) == 40
        if temperature == 0:
            assert out.sequences == plain.generate([prompt], config).sequences, i
        if i == 2:
            assert out.stats["capture_s"] == 0.0


def test_auto_sampled_calls_in_steady_state_compile_and_capture_nothing(model):
    """``--proposer auto`` after one call of each kind of round (greedy, sampled, sampled with
    top-p): later calls of every kind, whatever the prompt's length, temperature and top-k / top-p,
    and whichever candidates the controller switches among, compile and capture nothing."""
    import torch._dynamo

    _, path = model
    target = load_target(path, dtype=torch.bfloat16, device="cuda")
    draft = init_draft(DraftConfig.for_target(target, window=16), target)
    draft.config.acceptance = [[0.3, 0.4, 0.45, 0.5, 0.6, 0.7]] * 6
    gen = Generator(target, "auto", draft=draft)
    rng = torch.Generator().manual_seed(0)
    for temperature, top_p in ((0.0, 1.0), (1.0, 1.0), (0.7, 0.9)):
        gen.generate([torch.randint(0, 160, (50,), generator=rng).tolist()],
                     GenerationConfig(max_new_tokens=16, temperature=temperature, top_p=top_p, seed=1))
    frames = dict(torch._dynamo.utils.counters["frames"])
    switched = 0
    for i in range(12):
        prompt = torch.randint(0, 160, (20 + 19 * i,), generator=rng).tolist() * 2  # (the last near the end)
        temperature = (0.0, 1.0, 0.7, 0.5)[i % 4]
        config = GenerationConfig(max_new_tokens=24, temperature=temperature, top_p=0.9 if i % 4 == 2 else 1.0,
                                  top_k=20 if i % 4 == 3 else 0, seed=i, ignore_eos=True)
        out = gen.generate([prompt], config)
        assert out.stats["capture_s"] == 0.0, (i, len(prompt), out.stats.get("trees"), out.stats.get("auto"))
        switched += len(out.stats.get("trees", ())) > 1  # (none near the context's end: plain rounds)
    assert dict(torch._dynamo.utils.counters["frames"]) == frames, "something was compiled in steady state"
    assert switched, "the controller never switched: the test would not see a candidate's first rounds"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_lower_right_causal_attention_equals_eager(dtype):
    """A prefill chunk after cached tokens in a compiled step (flash's lower-right causal flag in
    half precision, an explicit mask in float32) against the eager ``causal_lower_right`` path
    and the float32 reference with an explicit mask, with GQA, and with no graph break."""
    from torch._dynamo.utils import counters
    from longspec.attention import causal_attention, dense_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, h, n, 64, generator=gen, device="cuda", dtype=dtype)
               for h, n in ((8, 48), (2, 112), (2, 112)))
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(causal_attention, fullgraph=True)(q, k, v)
    atol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out, causal_attention(q, k, v), atol=atol, rtol=0)
    m, s = q.shape[2], k.shape[2]
    visible = torch.arange(s - m, s, device="cuda")[:, None] >= torch.arange(s, device="cuda")[None, :]
    reference, _ = dense_attention(q.float(), k.float(), v.float(), visible.expand(2, m, s))
    torch.testing.assert_close(out.float(), reference, atol=atol, rtol=0)
    aot = counters["aot_autograd"]
    assert aot["autograd_cache_bypass"] == 0 and aot["autograd_cache_saved"] + aot["autograd_cache_hit"] >= 1, dict(aot)


@pytest.mark.parametrize("shape,k,biased", [((1, 16, 8192), 16, True), ((2, 4, 8192), 16, True),
                                            ((74, 1, 49152), 4, False), ((1, 1, 8192), 4, False)])
def test_select_top_on_cuda_is_topk(shape, k, biased):
    """The draft's top-k kernels at the draft's sizes (a beam level over 16 parents, a static
    level over the whole vocabulary) give torch.topk's values with indices that hold them,
    eagerly and inside a captured graph."""
    from longspec.spec.topk import top_k

    gen = torch.Generator(device="cuda").manual_seed(k)
    x = torch.randn(shape, generator=gen, device="cuda").log_softmax(-1)
    bias = torch.randn(shape[:2], generator=gen, device="cuda") if biased else None
    scores = (x if bias is None else x + bias[..., None]).flatten(1)
    ref, _ = torch.topk(scores, k, dim=-1)
    values, index = top_k(x, k, bias)
    assert torch.equal(values, ref) and torch.equal(scores.gather(1, index), values)
    graph, out = torch.cuda.CUDAGraph(), None
    with torch.cuda.graph(graph):
        out = top_k(x, k, bias)
    x.copy_(x.flip(-1))
    scores = (x if bias is None else x + bias[..., None]).flatten(1)
    graph.replay()
    assert torch.equal(out[0], torch.topk(scores, k, dim=-1).values)
    assert torch.equal(scores.gather(1, out[1]), out[0])


def exact_nucleus(scores: torch.Tensor, k: torch.Tensor, p: torch.Tensor):
    """scores [R, V] -> ([R, V] bool, [R, V] float64): what top-k then top-p keep, in float64 (a
    token is kept iff it is within the k largest, ties kept, and the mass above it is below p),
    and each token's mass above it."""
    s = scores.double()
    vocab = s.shape[-1]
    kth = s.sort(-1, descending=True).values.gather(-1, (k.clamp(1, vocab) - 1)[:, None])
    s = s.masked_fill(((k > 0) & (k < vocab))[:, None] & (s < kth), float("-inf"))
    probs, order = s.softmax(-1).sort(-1, descending=True)
    above = probs.cumsum(-1) - probs
    kept = torch.zeros_like(s, dtype=torch.bool).scatter(-1, order, (above < p.double()[:, None]) & (probs > 0))
    return kept, torch.empty_like(s).scatter(-1, order, above)


def assert_nucleus(kept: torch.Tensor, scores: torch.Tensor, k, p) -> None:
    """kept [R, V] bool == the float64 nucleus of scores [R, V], but for tokens at the cut: HF's
    formula, which ours is, scans the probabilities in float32, about 1e-6 from float64 over
    50k-260k tokens, about a token's probability at the cut there. Such a token falls on the
    wrong side in a few rows; a cut off by one token would in all."""
    exact, above = exact_nucleus(scores, k, p)
    differ = kept != exact
    assert not (differ & ((above - p.double()[:, None]).abs() > 1e-5)).any(), differ.sum(-1).nonzero().tolist()
    assert differ.any(-1).float().mean() <= 0.125, differ.sum(-1).nonzero().tolist()


@pytest.mark.parametrize("vocab", [49152, 262144])
def test_warping_on_cuda_keeps_the_exact_nucleus(vocab):
    """Top-k / top-p on CUDA (two sorts of the vocabulary per row) keep the tokens of the float64
    nucleus (but for a few rows' tokens at the cut), for a tree's 74 rows of logits at several
    scales (p up to 0.999), eagerly and in a graph; the warped distribution is the softmax over
    the tokens kept."""
    from longspec.spec import sampling

    gen = torch.Generator(device="cuda").manual_seed(vocab)
    for scale, top_k, top_p in ((1.0, 0, 0.9), (4.0, 0, 0.9), (4.0, 20, 0.8), (8.0, 1000, 0.99), (2.0, 0, 0.999)):
        logits = torch.randn(74, 1, vocab, generator=gen, device="cuda") * scale
        t = torch.full((74,), 0.7, device="cuda")
        k, p = torch.full((74,), top_k, device="cuda"), torch.full((74,), top_p, device="cuda")
        scores = logits / 0.7
        kept = sampling._truncate_sorting(scores, k.view(-1, 1, 1), p.view(-1, 1, 1)).isfinite()[:, 0]
        assert_nucleus(kept, scores[:, 0], k, p)
        ours = sampling.warp_probs_rows(logits, t, k, p)[:, 0]
        torch.testing.assert_close(ours, scores[:, 0].masked_fill(~kept, float("-inf")).softmax(-1), atol=1e-6, rtol=1e-5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sampling._truncate_sorting(scores, k.view(-1, 1, 1), p.view(-1, 1, 1))
    scores.mul_(0.5)
    graph.replay()
    assert_nucleus(out.isfinite()[:, 0], scores[:, 0], k, p)
