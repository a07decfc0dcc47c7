"""The cost model behind ``--proposer auto`` (``longspec/decoding/auto.py``): expected tokens per
round by hand, prompt lookup's hit rates on texts with known answers, the draft's acceptance table,
and the choice from costs (measured once, then read from the cache)."""
import json
import random
import statistics

import pytest
import torch

from longspec import load_target
from longspec.spec import acceptance
from longspec.decoding import auto, bucket_choice, corrections, step_costs
from longspec.spec.acceptance import ACCEPTANCE_WIDTHS, expected_tokens, lookup_acceptance, measure_acceptance
from longspec.decoding.auto import resolve
from longspec.decoding.step_costs import device_key
from longspec.spec.tree import TreeSpec
from longspec.models.draft import DraftConfig, init_draft

ROW = [0.5, 0.6, 0.65, 0.7, 0.8, 0.9]  # top-1, 2, 3, 4, 8, 16


def pick(target, ids, draft, costs_file):
    """(proposer, the cost model's first tree or None, the draft, why) as ``resolve`` plans them."""
    plan = resolve(target, ids, draft, costs_file=costs_file)
    return plan.name, plan.start, plan.draft, plan.note
assert len(ROW) == len(ACCEPTANCE_WIDTHS)


def test_expected_tokens_by_hand():
    deeper = [0.4, 0.5, 0.55, 0.6, 0.7, 0.8]
    beam = TreeSpec.parse("2,2")
    assert expected_tokens(beam, [ROW, deeper]) == pytest.approx(1 + 0.6 + 0.6 * 0.5)
    # the lookup chain takes one slot per level: draft top-1 there, combined halfway between
    # independent hits and the better of the two (HIT_CORRELATION)
    assert acceptance.HIT_CORRELATION == 0.5
    level1 = 0.5 * 0.5 + 0.5 * (1 - 0.5 * 0.5)  # draft top-1 0.5, lookup 0.5
    level2 = 0.5 * 0.5 + 0.5 * (1 - 0.6 * 0.5)  # draft top-1 0.4, lookup 0.5
    assert expected_tokens(beam, [ROW, deeper], [0.5, 0.5]) == pytest.approx(1 + level1 + level1 * level2)
    assert expected_tokens(TreeSpec.chain(2), lookup=[0.3, 0.6]) == pytest.approx(1 + 0.3 + 0.3 * 0.6)
    # widths between measured columns interpolate; deeper levels reuse the last row
    assert expected_tokens(TreeSpec.parse("6"), [ROW]) == pytest.approx(1 + 0.75)
    assert expected_tokens(TreeSpec.parse("1,1,1"), [ROW]) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    # a one-node level inside the beam holds the lookup's candidate or the draft's: the better rate;
    # the trailing one-node levels (the lookup tail) hold the lookup's alone
    level1 = 0.5 * 0.9 + 0.5 * (1 - 0.5 * 0.1)  # the first level (2 slots): draft top-1 0.5, lookup 0.9
    assert expected_tokens(TreeSpec.parse("2,1,1"), [ROW], [0.9, 0.8, 0.3]) == pytest.approx(
        1 + level1 + level1 * 0.8 + level1 * 0.8 * 0.3)
    level3 = 0.5 * 0.7 + 0.5 * (1 - 0.5 * 0.3)  # "2,1,2": the middle level's one node, then 2 slots
    assert expected_tokens(TreeSpec.parse("2,1,2"), [ROW], [0.9, 0.3, 0.7]) == pytest.approx(
        1 + level1 + level1 * 0.5 + level1 * 0.5 * level3)


def test_lookup_acceptance_on_known_texts():
    periodic = [1, 2, 3, 4, 5] * 60
    assert lookup_acceptance(periodic, depths=3, tail=200) == [1.0, 1.0, 1.0]
    rng = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 100000, (600,), generator=rng).tolist()  # no repeats: no match, no hit
    assert lookup_acceptance(noise, depths=2, tail=500)[0] == 0.0
    half = [7, 8] * 100 + torch.randint(1000, 100000, (200,), generator=rng).tolist()
    q = lookup_acceptance(half, depths=1, tail=400)[0]
    assert 0.45 < q < 0.55


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    _, path = tiny_model_factory("auto", "llama", num_hidden_layers=2, max_position_embeddings=256, seed=4)
    target = load_target(path)
    draft = init_draft(DraftConfig.for_target(target, window=16), target)
    return target, draft


def test_measure_acceptance_table(tiny):
    target, draft = tiny
    ids = torch.randint(0, 160, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    table = measure_acceptance(draft, target, ids, depths=3, chunk=128)
    assert len(table) == 3 and all(len(row) == len(ACCEPTANCE_WIDTHS) for row in table)
    for row in table:
        assert all(0.0 <= a <= b <= 1.0 for a, b in zip(row, row[1:])), row
    # a draft that can only name tokens the text never uses never hits
    draft.limit_vocab([150, 151])
    text = torch.randint(0, 100, (200,), generator=torch.Generator().manual_seed(2)).tolist()
    assert measure_acceptance(draft, target, text, depths=2, chunk=128) == [[0.0] * len(ACCEPTANCE_WIDTHS)] * 2
    draft.config.draft_vocab = 0


def cost_contexts(target) -> set:
    """The contexts costs are measured at (the same whatever the prompt and the candidates)."""
    cap = target.config.max_position_embeddings - step_costs.COST_MARGIN
    return {min(c, cap) for c in step_costs.COST_CONTEXTS}


def fake_costs(target, path, prompt_len, target_ms, draft_ms):
    """Cached costs at every context a choice among the hybrid's or the lookup's candidates reads
    (they are the same whatever the prompt's length)."""
    contexts = cost_contexts(target)
    path.write_text(json.dumps({f"{device_key(target)} | {c}": {"target_ms": target_ms, "draft_ms": draft_ms}
                                for c in contexts}))


def test_choice_follows_the_costs(tiny, tmp_path, monkeypatch):
    target, draft = tiny
    draft.config.acceptance = [[0.6, 0.7, 0.8, 0.9, 0.95, 0.99]]
    ids = list(range(40))  # no repeats: prompt lookup never hits
    monkeypatch.setattr(step_costs, "measure_costs", lambda *a, **k: pytest.fail("costs were cached"))
    costs = tmp_path / "costs.json"
    labels = [f"hybrid chain:{n}" for n in auto.LOOKUP_CHAINS] + [f"hybrid {t}" for t in auto.AUTO_TREES]
    sizes = {str(TreeSpec.parse(label.split()[1]).num_nodes) for label in labels} | {"1"}
    # verifying is as cheap as decoding: the deepest, widest tree pays most
    fake_costs(target, costs, len(ids), {m: 1.0 for m in sizes}, {label: 0.01 for label in labels})
    name, tree, chosen, why = pick(target, ids, draft, costs_file=str(costs))
    # (no lookup hits: the trees' lookup tails add nothing; the deepest beam pays most)
    assert (name, str(tree), chosen) == ("hybrid", "4,4,4,4,4,1,1,1,1,1", draft) and why.startswith("cost model")
    # the note says what was predicted for every candidate (a call's stats["auto"])
    assert all(f"{label}: " in why for label in labels) and "plain: 1 token in 1.00 ms" in why
    # (no repeats: on a CPU no round of the chain drafts, those that would are rated as a paying chain's)
    paying = expected_tokens(TreeSpec.chain(auto.LOOKUP_CHAINS[0]), lookup=auto.PAYING_HITS)
    assert f"hybrid chain:{auto.LOOKUP_CHAINS[0]}: {paying:.2f} tokens in 1.01 ms" in why
    # verifying costs grow with the tokens: plain decoding wins, in the hybrid's engine
    fake_costs(target, costs, len(ids), {m: float(m) for m in sizes}, {label: 0.5 for label in labels})
    assert pick(target, ids, draft, costs_file=str(costs))[:3] == ("hybrid", None, draft)
    # no draft: only lookup chains compete
    labels = [f"pld chain:{n}" for n in auto.LOOKUP_CHAINS]
    fake_costs(target, costs, len(ids), {m: 1.0 for m in sizes}, {label: 0.01 for label in labels})
    assert pick(target, [1, 2, 3] * 40, None, costs_file=str(costs))[:2] == ("pld", TreeSpec.chain(max(auto.LOOKUP_CHAINS)))


def test_one_chain_by_the_step_costs(tiny, tmp_path):
    """Of the lookup chains, the controller gets the one the step costs rate best (a CPU's matrix
    kernels take a step's rows in blocks whose size differs between CPUs), compared where a chain
    pays (PAYING_HITS) when the prompt repeats less; the note still shows every chain's prediction."""
    target, draft = tiny
    draft.config.acceptance = [[0.5, 0.6, 0.7, 0.8, 0.9, 0.99]]
    costs = tmp_path / "costs.json"
    labels = [f"hybrid chain:{n}" for n in auto.LOOKUP_CHAINS] + [f"hybrid {t}" for t in auto.AUTO_TREES]
    sizes = {str(TreeSpec.parse(label.split()[1]).num_nodes) for label in labels} | {"1"}
    ids = list(range(40))  # (no repeats)
    chains = {TreeSpec.chain(n) for n in auto.LOOKUP_CHAINS}
    for step, picked in (({m: 1.0 for m in sizes}, max(auto.LOOKUP_CHAINS)),  # every count alike: the longest
                         ({m: 1.0 + 0.5 * (int(m) > 6) for m in sizes}, 5)):  # a 7th row dear: 6 rows of 4 and 6
        fake_costs(target, costs, len(ids), step, {label: 0.01 for label in labels})
        plan = resolve(target, ids, draft, costs_file=str(costs))
        assert chains & set(plan.predicted) == {TreeSpec.chain(picked)}
        assert all(f"hybrid chain:{n}: " in plan.note for n in auto.LOOKUP_CHAINS)


def test_a_chain_the_prompts_own_hits_rate_best_gives_way_to_the_one_kept(tiny, tmp_path, monkeypatch):
    """The cost model may rate a chain best at the prompt's own hit rates (a prompt that repeats
    three tokens at a time) while the chain kept for the controller is rated where a chain pays
    (PAYING_HITS): the plan starts with the kept one, not with a chain it no longer has (a
    KeyError on a CPU's own step costs)."""
    target, draft = tiny
    draft.config.acceptance = [[0.5, 0.6, 0.7, 0.8, 0.9, 0.99]]
    costs = tmp_path / "costs.json"
    labels = [f"hybrid chain:{n}" for n in auto.LOOKUP_CHAINS] + [f"hybrid {t}" for t in auto.AUTO_TREES]
    sizes = {str(TreeSpec.parse(label.split()[1]).num_nodes) for label in labels} | {"1"}
    draft_ms = {label: 0.01 if "chain" in label else 100.0 for label in labels}  # (the trees out of the race)
    fake_costs(target, costs, 40, {m: 1.0 + 0.05 * int(m) for m in sizes}, draft_ms)
    hits = (0.95, 0.95, 0.95) + (0.05,) * 7
    monkeypatch.setattr(auto, "_lookup_of", lambda recent: (None, hits))
    candidates = auto._candidates(list(range(40)), draft, hits)
    label, _, table = step_costs.choose(target, candidates, 40, str(costs))
    kept = auto._one_chain(candidates, table, hits)
    assert label == "hybrid chain:3" and label not in kept  # (the case: rated best, not kept)
    plan = resolve(target, list(range(40)), draft, costs_file=str(costs))
    assert plan.start in plan.predicted and plan.start.kind == "chain" and plan.start != TreeSpec.chain(3)


def test_on_cuda_the_hybrids_engine_also_runs_its_lookup_alone(tiny, tmp_path, monkeypatch):
    """On CUDA with a draft, auto weighs the hybrid's tree and its lookup's chain (run by the same
    hybrid proposer, so one engine serves both), the chain rated on the lookup's hits alone; the
    trees an engine captures on auto's first call are exactly those candidates'."""
    target, draft = tiny
    monkeypatch.setattr(draft.config, "acceptance", [[0.3, 0.4, 0.45, 0.5, 0.6, 0.7]] * 6)
    repeating = list(range(60)) * 3
    hits = lookup_acceptance(repeating)
    on_cuda = auto._candidates(repeating, draft, hits, on_cuda=True)
    chain = TreeSpec.chain(auto.GPU_LOOKUP_CHAINS[0])
    assert set(on_cuda) == {f"hybrid {t}" for t in auto.GPU_CANDIDATE_TREES} | {f"hybrid {chain}"}
    assert on_cuda[f"hybrid {chain}"][2] == pytest.approx(expected_tokens(chain, lookup=hits))
    assert type(on_cuda[f"hybrid {chain}"][1]()).__name__ == "LongSpecProposer"
    assert set(auto._candidates(repeating, None, hits, on_cuda=True)) == {f"pld {chain}"}
    assert auto.candidate_trees(draft) == [TreeSpec.parse(t) for t in auto.GPU_CANDIDATE_TREES] + [chain]
    assert auto.candidate_trees(None) == [chain]
    tableless = init_draft(DraftConfig.for_target(target, window=16), target)  # pick's default tree alone
    assert not tableless.config.acceptance and auto.candidate_trees(tableless) == [TreeSpec.parse(auto.HYBRID_TREE)]
    # its costs: the chain drafted by a hybrid begun with its beam tree, as in the engine
    costs = step_costs.measure_costs(target, on_cuda, context=64, repeats=1)
    assert set(costs["draft_ms"]) == set(on_cuda) and min(costs["draft_ms"].values()) > 0
    # as pick runs on CUDA: drafting costly, verifying cheap, a repeating text -> the hybrid's chain
    candidates = auto._candidates
    monkeypatch.setattr(auto, "_candidates", lambda ids, d, h, on_cuda=False, chain_hits=None: candidates(ids, d, h, True))
    costs = tmp_path / "costs.json"
    fake_costs(target, costs, len(repeating), {str(m): 1.0 for m in range(1, 80)},
               {f"hybrid {t}": 5.0 for t in auto.GPU_CANDIDATE_TREES} | {f"hybrid {chain}": 0.05})
    assert pick(target, repeating, draft, costs_file=str(costs))[:3] == ("hybrid", chain, draft)
    plan = resolve(target, repeating, draft, costs_file=str(costs))
    assert set(plan.predicted) == {*auto.candidate_trees(draft), None} and plan.tree == auto.candidate_trees(draft)[0]
    # drafting cheap: the hybrid's tree, whose draft levels add to the lookup's
    fake_costs(target, costs, len(repeating), {str(m): 1.0 for m in range(1, 80)},
               {f"hybrid {t}": 0.05 for t in auto.GPU_CANDIDATE_TREES} | {f"hybrid {chain}": 0.05})
    assert pick(target, repeating, draft, costs_file=str(costs))[1] == TreeSpec.parse(auto.GPU_CANDIDATE_TREES[0])


def test_costs_are_measured_once(tiny, tmp_path):
    target, draft = tiny
    draft.config.acceptance = [ROW]
    costs = tmp_path / "costs.json"
    choice = pick(target, [1, 2, 3, 4] * 10, draft, costs_file=str(costs))
    (entry,) = json.loads(costs.read_text()).values()
    assert set(entry["target_ms"]) >= {"1", "26"} and len(entry["draft_ms"]) == len(auto.LOOKUP_CHAINS) + len(auto.AUTO_TREES)
    assert all(ms > 0 for ms in [*entry["target_ms"].values(), *entry["draft_ms"].values()])
    before = costs.read_text()
    assert pick(target, [1, 2, 3, 4] * 10, draft, costs_file=str(costs))[:2] == choice[:2]
    assert costs.read_text() == before
    costs.write_text("not json")  # a damaged cache is measured again, not an error
    assert pick(target, [1, 2, 3, 4] * 10, draft, costs_file=str(costs))[0] == "hybrid"


def test_bucket_trees_follow_the_costs_at_each_batch(tiny, tmp_path, monkeypatch):
    """A serving engine's buckets get, each, the candidate tree with the most tokens per second at
    that batch: the engine's own tree where verifying stays cheap, a small one where many rows
    make every verified token cost, plain rounds (None) where no tree pays; costs are measured
    per batch (and cached under it)."""
    from longspec.spec.proposers import LongSpecProposer, PromptLookup

    target, draft = tiny
    hybrid = LongSpecProposer(draft, PromptLookup())
    big = TreeSpec.parse(auto.HYBRID_TREE)
    draft.config.acceptance = []
    assert bucket_choice.bucket_trees(target, hybrid, big, [1, 4], 100)[0] == {}  # no table: nothing to predict from
    draft.config.acceptance = [[0.5, 0.6, 0.7, 0.8, 0.9, 0.99]]
    costs = tmp_path / "costs.json"
    chosen, lines = bucket_choice.bucket_trees(target, hybrid, big, [1, 4], 100, costs_file=str(costs))  # measured
    entries = json.loads(costs.read_text())
    (context,) = cost_contexts(target)
    assert sorted(k.rsplit("|", 1)[-1].strip() for k in entries) == sorted(["batch 4", str(context)])
    assert len(lines) == 2 and set(chosen) <= {1, 4}
    fits = [big, *(TreeSpec.parse(t) for t in auto.CANDIDATE_TREES)]
    labels = {f"hybrid {t}" for t in fits}
    sizes = {str(t.num_nodes) for t in fits} | {"1"}
    key = f"{device_key(target)} | {context}"
    costs.write_text(json.dumps({
        key: {"target_ms": {m: 1.0 for m in sizes}, "draft_ms": {label: 0.01 for label in labels}},
        key + " | batch 4": {"target_ms": {m: 1 + float(m) / 8 for m in sizes},
                             "draft_ms": {label: 0.01 for label in labels}},
        key + " | batch 16": {"target_ms": {m: float(m) for m in sizes}, "draft_ms": {label: 0.01 for label in labels}}}))
    monkeypatch.setattr(step_costs, "measure_costs", lambda *a, **k: pytest.fail("costs were cached"))
    chosen, lines = bucket_choice.bucket_trees(target, hybrid, big, [1, 4, 16], 100, costs_file=str(costs))
    # batch 1: every size costs the same, so the most tokens a round wins (a deeper candidate than
    # the engine's own tree, with this table)
    most = max(fits, key=lambda t: expected_tokens(t, draft.config.acceptance))
    assert most != big and most.fits_in(big)
    assert chosen == {1: most, 4: TreeSpec.parse("2,2,2"), 16: None}
    assert lines[0].startswith(f"bucket 1: {most} (") and lines[1].startswith("bucket 4: 2,2,2 (")
    assert lines[2] == "bucket 16: plain decoding (no tree predicted faster)"
    # a smaller engine tree bounds the candidates; chains do not suit the hybrid's lookup chain
    chosen, _ = bucket_choice.bucket_trees(target, hybrid, TreeSpec.parse("3,3,3,3"), [4], 100, costs_file=str(costs))
    assert chosen == {4: TreeSpec.parse("2,2,2")}
    draft.config.acceptance = []


def test_plan_repredicts_the_lookup_from_the_generated_texts_repeats(tiny, tmp_path):
    """A prompt that never repeats itself: on a CPU a chain's round drafts only where the lookup
    matched 2 tokens (else it is a decode step), and those rounds are rated as a paying chain's
    where the text has none, so the chain runs first; the lookup's hit rate on the generated text
    then predicts them again: many tokens a round once the generated text repeats the prompt,
    few where its 2-token matches miss, and where it drafts no round (or a few) near the
    prompt's rates."""
    target, _ = tiny
    ids = list(range(100))
    costs = tmp_path / "costs.json"
    labels = [f"pld chain:{n}" for n in auto.LOOKUP_CHAINS]
    # verifying m tokens costs 1 + m/5: a chain pays once the lookup hits often enough
    fake_costs(target, costs, len(ids), {str(m): 1.0 + m / 5 for m in range(1, 12)}, {k: 0.01 for k in labels})
    plan = resolve(target, ids, None, costs_file=str(costs))
    chain = plan.tree  # (the one chain the costs pick: see test_one_chain_by_the_step_costs)
    assert (plan.name, plan.start, chain.kind) == ("pld", chain, "chain") and set(plan.predicted) == {None, chain}
    paying = expected_tokens(chain, lookup=auto.PAYING_HITS)
    assert plan.predicted[chain][0] == pytest.approx(paying, abs=0.01) and plan.min_match == 2
    assert plan.repredict(ids + ids[10:50], len(ids))[chain] > 3.0  # (of at most 9)
    missing = [t for k in range(10) for t in (10 * k, 10 * k + 1, 200 + k)]  # (each 2-token match's guess wrong)
    assert plan.repredict(ids + missing, len(ids))[chain] < 1.6
    assert plan.repredict(ids + list(range(200, 240)), len(ids))[chain] == pytest.approx(paying, abs=0.01)
    assert plan.repredict(ids + [3, 4], len(ids))[chain] == pytest.approx(paying, abs=0.01)


def test_step_costs_on_a_cpu_are_timed_in_turn(monkeypatch):
    """On a CPU the cost model times its shapes in turn (one call of each a pass, after one
    warm-up call each), so a machine whose speed drifts moves them alike; each gets the median
    of its own calls."""
    ran = []
    clock = iter(range(1000))
    fns = {name: (lambda name=name: ran.append(name)) for name in ("1", "7", "chain")}
    monkeypatch.setattr(step_costs.time, "perf_counter", lambda: float(next(clock)))
    medians = step_costs._time(fns, torch.device("cpu"), repeats=3, reference="1")
    monkeypatch.undo()
    assert ran == ["1", "7", "chain"] * 4
    assert medians == {"1": 1.0, "7": 1.0, "chain": 1.0}


def test_step_costs_on_a_cpu_are_ratios_to_the_one_token_step_of_each_pass(monkeypatch, tiny):
    """On a CPU each shape's time is its median ratio to the one-token step's call in the same
    pass, times that step's median: a machine slowing down pass by pass, with one call slowed
    alone and one run in a quiet moment, keeps the shapes' order (their own medians put 8 tokens
    at less than half of 6 tokens' time). A CPU's tables of the earlier timing are not read."""
    assert device_key(tiny[0]).endswith(f" | v{step_costs.COSTS_VERSION}.{step_costs.CPU_COSTS_VERSION}")
    cost = {"1": 10.0, "6": 14.0, "8": 15.0}
    speed, odd = [1.0, 2.0, 3.0], {(0, "6"): 2.5, (2, "8"): 1.0}  # (the pass's speed, but for these calls)
    now, calls = [0.0], []

    def step(name):
        p = len(calls) // len(cost) - 1  # (the first call of each: a warm-up)
        calls.append(name)
        now[0] += cost[name] * (1.0 if p < 0 else odd.get((p, name), speed[p]))

    monkeypatch.setattr(step_costs.time, "perf_counter", lambda: now[0])
    fns = {name: (lambda name=name: step(name)) for name in cost}
    timed = step_costs._time(fns, torch.device("cpu"), repeats=3, reference="1")
    monkeypatch.undo()
    plain = {name: statistics.median(c * odd.get((p, name), speed[p]) for p in range(3)) for name, c in cost.items()}
    assert plain["8"] < 0.5 * plain["6"]  # (each shape's median of its own calls)
    assert timed == pytest.approx({"1": 20.0, "6": 28.0, "8": 30.0})


def timed_plain(c, ms: float):
    """``c`` as if it had timed plain rounds at ``ms`` in every kind of round these tests call
    (a process's first call of a kind runs them first)."""
    from longspec.decoding import controller

    for kind in (None, "greedy", "t1", "sampled", "truncated"):
        times, timed_at, _ = c.records(kind)
        times["plain"], timed_at["plain"] = [ms] * controller.SETTLED_ROUNDS, c.rounds
    return c


def test_a_process_times_plain_rounds_first_where_the_choice_hangs_on_them():
    """A controller that has not timed plain rounds runs them first where the candidate predicted
    fastest is predicted within RETIME_MARGIN of them (their time is what every candidate is
    weighed against, and the cost model's is the least reliable to scale), then at once that
    candidate; a call's decoding is then given against plain rounds' rate. A candidate predicted
    clearly faster runs at once, plain rounds untimed until they run."""
    from longspec.decoding import controller
    from longspec.decoding.controller import Controller

    chain = TreeSpec.chain(5)
    c = Controller()
    assert c.vs_plain(1.0) is None  # (nothing measured)
    ran = [c.begin({chain: (1.45, 1.2), None: (1.0, 1.0)}, "greedy")]
    # (what it plans to run once plain rounds are timed: what `longspec generate` announces)
    assert c.planned.tree == chain and c.gain() == pytest.approx(1.45 / 1.2)
    for _ in range(8):
        ran.append(c.observe(*((1.0, 1.1e-3) if ran[-1] is None else (4.0, 1.3e-3))))
    settled = controller.SETTLED_ROUNDS
    assert ran[:settled] == [None] * settled and set(ran[settled:]) == {chain}, ran
    assert c.round_ms("plain") == pytest.approx(1.1) and c.vs_plain(4.0 / 1.3) == pytest.approx(4.0 / 1.3 * 1.1)
    assert c.begin({chain: (1.45, 1.2), None: (1.0, 1.0)}, "greedy") == chain  # (the next call: timed already)
    clear = Controller()
    assert clear.begin({chain: (4.0, 1.2), None: (1.0, 1.0)}, "greedy") == chain
    assert [clear.observe(4.0, 1.3e-3) for _ in range(8)] == [chain] * 8 and clear.round_ms("plain") is None
    # rounds that do not pay give way to plain rounds (their time the cost model's, scaled as the
    # chain's measured against its own), which are then timed
    miss = Controller()
    assert miss.begin({chain: (4.0, 1.2), None: (1.0, 1.0)}, "greedy") == chain
    ran = [miss.observe(1.0, 1.3e-3) for _ in range(12)]
    assert ran[0] == chain and ran[-1] is None and miss.round_ms("plain") == pytest.approx(1.3), ran


def test_controller_keeps_the_faster_round_and_leaves_rounds_that_do_not_pay(monkeypatch):
    """The controller starts with the predicted fastest candidate; from measured rounds it keeps
    it where it pays, settles on plain rounds where nothing speculative does (leaving the costly
    tree within a few rounds), and carries round times and, per sampling setting, tokens per
    round over to its next calls."""
    monkeypatch.setattr(corrections, "PRIOR_EXTRA", 0.0)  # (the sums below alone)
    from longspec.decoding import controller
    from longspec.decoding.controller import Controller

    tree, chain = TreeSpec.parse("4,4,1"), TreeSpec.chain(5)
    predicted = {tree: (3.0, 2.0), chain: (2.0, 1.2), None: (1.0, 1.0)}  # tokens/ms: 1.5, 1.67, 1
    truth = {tree: (1.0, 2.0), chain: (1.0, 1.2), None: (1.0, 1.0)}  # nothing speculative hits

    def run(c, rounds, truth):
        ran = [c.current.tree]
        for _ in range(rounds):
            tokens, ms = truth[c.current.tree]
            ran.append(c.observe(tokens, ms / 1e3))
        return ran

    c = timed_plain(Controller(), 1.0)
    assert c.begin(predicted, "greedy") == chain
    ran = run(c, 60, truth)
    dwell = controller.DWELL  # (rounds a candidate runs before another may take over)
    settled = controller.SETTLED_ROUNDS
    assert ran[:2 * settled + dwell].count(chain) <= 2 * settled + 1  # left soon
    # the tree is not tried: none of the chain's predicted extra tokens came, so none of the
    # tree's are expected in this call either
    assert tree not in ran and c.candidates["4,4,1"].prior == 1.0
    assert set(ran[-15:]) == {None}  # then plain rounds for good
    c.end()
    assert {name: c.round_ms(name) for name in c.times} == pytest.approx({"chain:5": 1.2, "plain": 1.0})
    assert c.learned.pairs[("chain", "greedy")][0] == 0.0  # (no extra token measured)
    # the next greedy call: none of the chain's extra tokens came, so few are expected (but
    # enough that a prompt predicted to repeat much gets a few rounds again); the tree, never
    # measured, starts from the cost model and runs first
    assert c.begin(predicted, "greedy") == tree
    low = 1 + corrections.MIN_CORRECTION
    assert c.candidates["chain:5"].prior == pytest.approx(low) and c.candidates["4,4,1"].prior == 3.0
    c.begin(predicted, "sampled")
    assert c.candidates["chain:5"].prior == pytest.approx(2.0)  # (nothing measured at that setting yet)
    # where the chain pays, it runs throughout
    c = timed_plain(Controller(), 1.0)
    c.begin(predicted, "greedy")
    assert set(run(c, 40, {**truth, chain: (5.0, 1.2)})) == {chain}
    # a round's time is the median of the last rounds: one slow round does not move it, a slower
    # context does
    assert c.round_ms("chain:5") == pytest.approx(1.2)
    c.observe(5.0, 9e-3)
    assert c.round_ms("chain:5") == pytest.approx(1.2)
    for _ in range(controller.TIME_WINDOW // 2 + 1):
        c.observe(5.0, 1.5e-3)
    assert c.round_ms("chain:5") == pytest.approx(1.5)


def test_controller_scales_unmeasured_times_and_takes_sampled_acceptance_from_earlier_calls(monkeypatch):
    """The cost model's times run long (uncompiled steps): a candidate never run is predicted at
    its time scaled like the measured ones' (here plain rounds': 0.8 of the prediction), so a
    chain accepting little at temperature 1 gives way to plain rounds; a sampled call's tokens a
    round come from earlier calls at its setting, not from the greedy prediction."""
    monkeypatch.setattr(corrections, "PRIOR_EXTRA", 0.0)  # (the sums below alone)
    from longspec.decoding.controller import Controller

    chain, t1 = TreeSpec.chain(5), (1.0, 0, 1.0)
    predicted = {chain: (1.8, 1.84), None: (1.0, 1.5)}
    truth = {chain: (1.1, 1.5), None: (1.0, 1.2)}
    c = timed_plain(Controller(), 1.2)
    ran = [c.begin(predicted, t1)]
    for _ in range(60):
        ran.append(c.observe(*[truth[ran[-1]][0], truth[ran[-1]][1] / 1e3]))
    assert ran[0] == chain and set(ran[-20:]) == {None}
    assert c.candidates["plain"].ms == pytest.approx(1.2)
    c.end()
    assert c.begin(predicted, t1) is None  # the chain's 1.1 tokens in 1.5 ms: plain from the start
    low = corrections.MIN_CORRECTION  # (of the 0.8 extra tokens predicted, 0.1 came)
    assert c.candidates["chain:5"].prior == pytest.approx(1 + 0.8 * low)
    # a prompt where the cost model predicts more: the same share of its extra tokens, here too
    # few to pay (a new prediction while generating is corrected alike)
    assert c.begin({chain: (2.0, 1.84), None: (1.0, 1.5)}, t1) is None
    assert c.candidates["chain:5"].prior == pytest.approx(1 + low)
    c.repredict({chain: 5.0})
    assert c.candidates["chain:5"].prior == pytest.approx(1 + 4 * low)


def test_hybrid_chain_rounds_are_the_lookups_own(tiny):
    """A hybrid engine switched to a chain drafts what prompt lookup alone drafts: the same
    tokens and the same accepted counts round by round, and beam trees can return after it."""
    from longspec import GenerationConfig
    from longspec.decoding.generator import Generator
    from longspec.spec.proposers import LongSpecProposer, PromptLookup

    target, draft = tiny
    prompt = torch.randint(0, 160, (50,), generator=torch.Generator().manual_seed(5)).tolist() * 3
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    plain = Generator(target).generate([prompt], config).sequences[0]
    alone = Generator(target, PromptLookup(), "chain:4").generate([prompt], config)
    chain = Scripted(TreeSpec.chain(4), [TreeSpec.chain(4)] * 8)
    hybrid = Generator(target, LongSpecProposer(draft, PromptLookup()), "4,4,4,1,1", controller=chain)
    out = hybrid.generate([prompt], config)
    assert out.sequences[0] == alone.sequences[0] == plain
    assert out.stats["accepted_hist"][:5] == alone.stats["accepted_hist"] and out.stats["tau"] > 1.0
    back = Scripted(TreeSpec.chain(4), [TreeSpec.parse("3,3,1"), TreeSpec.chain(2), None] * 4)
    hybrid.controller = back
    assert hybrid.generate([prompt], config).sequences[0] == plain


def test_lookup_acceptance_prior():
    text = list(range(50)) + [1, 2, 3]  # 3 generated positions: 2 hits (after 1 comes 2, after 2 comes 3)
    assert lookup_acceptance(text, depths=1, tail=3)[0] == pytest.approx(2 / 3, abs=1e-3)
    assert lookup_acceptance(text, depths=1, tail=3, prior=[0.0], prior_weight=3)[0] == pytest.approx(2 / 6, abs=1e-3)


class Scripted:
    """A controller that switches on a script: every ``every`` rounds to the script's next tree."""
    every = 3

    def __init__(self, start, script):
        self.start, self.script, self.calls, self.current = start, list(script), [], start

    def begin(self, predicted, sampling):
        self.rounds, self.current = 0, self.start
        return self.start

    def observe(self, tokens, seconds, tree):
        self.rounds += 1
        if self.rounds % self.every == 0 and self.script:
            self.calls.append(self.rounds)
            self.current = self.script.pop(0)
        return self.current

    def end(self):
        pass


def test_a_chains_rounds_that_drafted_nothing_are_observed_as_plain_rounds(tiny):
    """On a CPU a lookup chain's round without a 2-token match is a decode step: the controller
    observes it as a plain round (one token, a plain round's time), not as one of the chain's
    (whose rounds then say what it makes where it drafts); the output is plain decoding's."""
    from longspec import GenerationConfig
    from longspec.decoding.generator import Generator
    from longspec.spec.proposers import PromptLookup

    class Recorded(Scripted):
        def observe(self, tokens, seconds, tree):
            seen.append((tree, tokens))
            return super().observe(tokens, seconds, tree)

    target, _ = tiny
    seen, chain = [], TreeSpec.chain(4)
    prompt, config = list(range(20, 60)), GenerationConfig(max_new_tokens=40, ignore_eos=True)
    plain = Generator(target).generate([prompt], config).sequences[0]
    out = Generator(target, PromptLookup(), chain, controller=Recorded(chain, [])).generate([prompt], config)
    assert out.sequences[0] == plain
    assert {tree for tree, _ in seen} == {None, chain} and seen[0][0] is None  # (no match at first)
    assert all(tokens == 1 for tree, tokens in seen if tree is None)


@pytest.mark.parametrize("family", ["pld", "hybrid"])
@pytest.mark.parametrize("ahead", [False, True])
def test_switching_trees_while_generating_keeps_the_output(tiny, family, ahead):
    """Trees switched by a controller, weighing each round at once (a CPU's way) or while the next
    runs (a GPU's: its choice a round later): the output is plain decoding's. Rows join plain
    rounds without the proposer taking them in, a lookup chain takes in the lookup's history only,
    and the next tree every row (the draft's window too)."""
    from longspec import GenerationConfig
    from longspec.decoding.generator import Generator
    from longspec.spec.proposers import LongSpecProposer, PromptLookup

    target, draft = tiny
    prompt = torch.randint(0, 160, (60,), generator=torch.Generator().manual_seed(3)).tolist() * 2
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    plain = Generator(target).generate([prompt], config).sequences[0]
    if family == "pld":
        proposer, biggest = PromptLookup(), TreeSpec.chain(10)
        script = [TreeSpec.chain(4), TreeSpec.chain(2), TreeSpec.chain(2), None]
    else:
        proposer, biggest = LongSpecProposer(draft, PromptLookup()), TreeSpec.parse("4,4,4,1,1")
        script = [TreeSpec.parse("2,2"), None, TreeSpec.chain(3), TreeSpec.parse("3,3,3,1,1"), TreeSpec.parse("2,2")]
    added, add = [], proposer.add
    proposer.add = lambda row, text, last, tree=None: (added.append((len(text), tree)), add(row, text, last, tree))
    scripted = Scripted(None, script)
    gen = Generator(target, proposer, biggest, controller=scripted)
    gen.launch_ahead = ahead
    from longspec.engine.engine import Engine

    real, in_flight, finish, ran = Engine.use_tree, [], Engine.finish, []

    def finished(engine, streamer=None):  # (each round's tree, and the tokens before it)
        ran.append((engine._in_flight[0][0].tree, len(next(s for s in engine.rows if s is not None).tokens)))
        return finish(engine, streamer)

    with pytest.MonkeyPatch.context() as patch:  # (a switch waits for no round, but a tree's that adds to the text it takes in)
        patch.setattr(Engine, "use_tree", lambda engine, tree: (
            in_flight.append((engine.tree_of(engine.buckets[0]), tree, engine.in_flight)), real(engine, tree)))
        patch.setattr(Engine, "finish", finished)
        out = gen.generate([prompt], config)
    assert out.sequences[0] == plain and any(n for *_, n in in_flight) == ahead
    # from plain rounds to a tree: taken in behind the plain round in flight
    assert any(n for before, tree, n in in_flight if before is None and tree is not None) == ahead
    # each switch is given at the tokens generated before its tree's first round
    assert [(at, None if tree is None else str(tree)) for (tree, at), (before, _) in zip(ran[1:], ran)
            if tree != before] == out.stats["trees"][1:]
    assert len(scripted.calls) >= 3
    switched = [tree for _, tree in out.stats["trees"]]
    assert switched[0] is None and len(switched) >= 3 and all(a != b for a, b in zip(switched, switched[1:]))
    # taken in: not when the row joined plain rounds; at each switch to a tree after plain rounds
    # or a lookup chain: the history only for a hybrid's chain
    n = len(prompt)
    expected = [(n + at - 1, TreeSpec.chain(3) if family == "hybrid" and tree == "chain:3" else None)
                for (at, tree), (_, before) in zip(out.stats["trees"][1:], out.stats["trees"])
                if tree is not None and (before is None or before.startswith("chain") and family == "hybrid")]
    assert added == expected and added
    assert gen._engine.parked and out.stats["verify_s"] > 0  # the replaced rounds' times still count
    with pytest.MonkeyPatch.context() as patch:  # a tree used before is not checked again (a copy to the device: a wait)
        patch.setattr(type(proposer), "with_tree", lambda self, tree: pytest.fail(f"{tree} checked again"))
        gen._engine.use_tree(script[0])
    # the next calls start again from the controller's start; a tree that returns takes its parked
    # rounds back (nothing piles up)
    for _ in range(3):
        scripted.script = [TreeSpec.chain(3) if family == "pld" else TreeSpec.parse("2,2"), None] * 5
        assert gen.generate([prompt], config).sequences[0] == plain
    assert len(gen._engine.parked) <= len(set(map(str, script))) + 1
    # a batch switches too (every row caught up when a tree follows plain rounds)
    scripted.script = [TreeSpec.chain(3) if family == "pld" else TreeSpec.parse("2,2"), None] * 5
    two = gen.generate([prompt, prompt[:50]], config)
    assert two.sequences[0] == plain and two.sequences[1] == Generator(target).generate([prompt[:50]], config).sequences[0]
    assert len(two.stats["trees"]) >= 3
    with pytest.raises(ValueError, match="does not fit"):
        gen._engine.use_tree(TreeSpec.chain(12) if family == "pld" else TreeSpec.parse("8,8"))
    from longspec.engine.engine import Sequence

    engine, tree = gen._engine, TreeSpec.chain(3) if family == "pld" else TreeSpec.parse("2,2")
    with torch.inference_mode():  # a tree that takes the rows in waits for rounds in flight but one plain round
        seq = Sequence(prompt, 8)
        engine.add([seq])
        engine.use_tree(None)
        engine.launch()
        engine.launch(ahead=True)
        assert engine.waits_for_rounds(tree)
        with pytest.raises(RuntimeError, match="takes the rows in"):
            engine.use_tree(tree)
        engine.finish()
        engine.use_tree(tree)
        engine.launch(ahead=True)
        engine.use_tree(None)
        assert not engine.waits_for_rounds(None)
        assert engine.waits_for_rounds(tree)  # (behind a tree's round)
        while engine.in_flight:
            engine.finish()
        while engine.has_active:
            engine.step()
    assert seq.tokens == plain[:8]


def test_rounds_launched_ahead_give_the_controller_their_own_times_only(tiny):
    """A GPU's rounds are launched ahead: a round's time is the device's from the last round's
    end to its own. The call's first round (launched from idle: its launch, and the prefill's
    tail, in its time), the rounds in flight while the host switched trees and the first round
    after a switch (the rows taken in before it) give the controller no time (None), every other
    round one; on a CPU (rounds one after another) every round gives its time."""
    from longspec import GenerationConfig
    from longspec.decoding.generator import Generator
    from longspec.spec.proposers import PromptLookup

    target, _ = tiny
    prompt = torch.randint(0, 160, (40,), generator=torch.Generator().manual_seed(5)).tolist() * 2
    config = GenerationConfig(max_new_tokens=30, ignore_eos=True)

    class Timed(Scripted):
        every = 6

        def observe(self, tokens, seconds, tree):
            self.seen.append((seconds, self.current))
            return super().observe(tokens, seconds, tree)

    for ahead in (True, False):
        timed = Timed(None, [TreeSpec.chain(3), None, TreeSpec.chain(3)])
        timed.seen = []
        gen = Generator(target, PromptLookup(), TreeSpec.chain(4), controller=timed)
        gen.launch_ahead = ahead
        out = gen.generate([prompt], config)
        assert out.sequences[0] == Generator(target).generate([prompt], config).sequences[0]
        untimed = [i for i, (seconds, _) in enumerate(timed.seen) if seconds is None]
        if not ahead:
            assert untimed == [] and len(timed.seen) > 12
            continue
        switches = [i for i, ((_, a), (_, b)) in enumerate(zip(timed.seen, timed.seen[1:]), 1) if a != b]
        assert len(switches) == 3
        # the first round; at each switch (chosen at round i - 1's observation, round i in flight),
        # round i and the new tree's first, i + 1; the last rounds (no room to launch one ahead)
        assert all({i, i + 1} <= set(untimed) for i in switches)
        rest = sorted(set(untimed) - {0} - {j for i in switches for j in (i, i + 1)})
        assert untimed[0] == 0 and rest == list(range(len(timed.seen) - len(rest), len(timed.seen)))
        assert len(rest) <= 4
        assert all(seconds > 0 for seconds, _ in timed.seen if seconds is not None)
        assert len(timed.seen) - len(untimed) >= 6


def test_the_warm_up_takes_a_row_in_once_and_changes_nothing(tiny):
    """The warm-up runs the proposer's take-in once (row 0, as long a text as a row holds), so
    that ``auto``'s first switch to a tree that takes the rows in loads nothing mid-request. The
    row is taken in again before a round drafts from it (at admission, or at the switch after
    plain rounds that left the proposer behind): the rounds, and the proposer's state after them,
    are an engine's without the warm-up."""
    from longspec.engine.engine import Engine, Sequence
    from longspec.spec.proposers import LongSpecProposer, PromptLookup

    target, draft = tiny
    prompt = torch.randint(0, 160, (50,), generator=torch.Generator().manual_seed(5)).tolist() * 2

    def run(first, warm: bool):
        proposer = LongSpecProposer(draft, PromptLookup())
        engine = Engine(target, proposer, TreeSpec.parse("4,4,4,1,1"), max_batch=1, max_len=192)
        added, add = [], proposer.add
        proposer.add = lambda row, text, last, tree=None: (added.append((row, len(text), tree)),
                                                            add(row, text, last, tree))
        if warm:
            engine.warm_up()
            assert added == [(0, engine.max_len - 1, None)] and "the proposer's take-in" in engine.warm_up_seconds
        def row_state():  # (row 0's, where it holds something)
            ring, lookup = proposer.ring, proposer.lookup
            valid = ring.slot_index[0] >= 0
            return [ring.slot_index[0].clone(), ring.slot_node[0].clone(), ring.k[0][:, valid], ring.v[0][:, valid],
                    proposer.reread_count[0].clone(), lookup.hist[0].clone(), lookup.hist_len[0].clone()]

        engine.use_tree(first)
        seq, states = Sequence(prompt, 12), []
        with torch.inference_mode():
            engine.add([seq])
            states += row_state() if first is not None else []  # (taken in: before the first round drafts)
            for _ in range(2):
                engine.step()
            engine.use_tree(TreeSpec.parse("3,3,3,1,1"))
            states += row_state() if first is None else []  # (taken in at the switch)
            while engine.has_active:
                engine.step()
        return seq.tokens, engine.rounds, added[warm:], states + row_state()

    for first in [TreeSpec.parse("2,2"), None]:
        tokens, rounds, added, states = run(first, warm=True)
        cold = run(first, warm=False)
        assert (tokens, rounds, added) == cold[:3]
        assert all(torch.equal(a, b) for a, b in zip(states, cold[3], strict=True))
        # taken in once more: at admission before a tree's rounds, at the switch after plain ones
        assert [n for _, n, _ in added] == [len(prompt) + 2 * (first is None)]
    engine = Engine(target, LongSpecProposer(draft, PromptLookup()), TreeSpec.parse("2,2"), max_batch=1, max_len=64)
    engine.add([Sequence(prompt[:20], 4)])
    with pytest.raises(RuntimeError, match="row 0 free"):
        engine.prepare_take_in()


def test_switching_needs_a_proposer(tiny):
    from longspec.engine.engine import Engine

    target, _ = tiny
    with pytest.raises(ValueError, match="proposer"):
        Engine(target, None, None, max_len=64).use_tree(None)


def test_costs_measured_at_two_contexts_serve_every_prompt_length(tiny, tmp_path, monkeypatch):
    """Costs measured once at the two contexts of COST_CONTEXTS are interpolated (and past the
    second, extrapolated) linearly in the prompt's length: no prompt length measures anything."""
    target, _ = tiny
    monkeypatch.setattr(target.config, "max_position_embeddings", 16384)
    monkeypatch.setattr(step_costs, "COST_CONTEXTS", (1024, 8192))
    monkeypatch.setattr(step_costs, "measure_costs", lambda *a, **k: pytest.fail("costs were cached"))
    costs = tmp_path / "costs.json"
    at = {1024: ({"1": 40.0, "6": 60.0}, 2.0), 8192: ({"1": 68.0, "6": 116.0}, 9.0)}
    costs.write_text(json.dumps({f"{device_key(target)} | {c}": {"target_ms": t, "draft_ms": {"pld chain:5": d}}
                                 for c, (t, d) in at.items()}))
    chain = TreeSpec.chain(5)
    for n, plain, verify, draft in ((4608, 54.0, 88.0, 5.5), (1024, 40.0, 60.0, 2.0), (300, 40.0, 60.0, 2.0),
                                    (8192, 68.0, 116.0, 9.0), (15360, 96.0, 172.0, 16.0)):
        _, _, used = step_costs.choose(target, {"pld chain:5": (chain, None, 2.0)}, n, str(costs))
        assert used["target_ms"] == pytest.approx({"1": plain, "6": verify})
        assert used["draft_ms"] == pytest.approx({"pld chain:5": draft})


def test_step_costs_are_floored_at_the_one_token_step():
    """No token count costs less than the one-token step; each keeps its own time otherwise, also
    below a smaller count's (a CPU's matrix kernels take rows in blocks)."""
    assert step_costs.floored({"1": 57.5, "2": 53.1, "3": 62.5, "11": 60.0}) == pytest.approx(
        {"1": 57.5, "2": 57.5, "3": 62.5, "11": 60.0})
    assert step_costs.floored({"1": 64.8, "4": 100.2, "6": 145.9, "7": 181.7, "8": 128.2}) == pytest.approx(
        {"1": 64.8, "4": 100.2, "6": 145.9, "7": 181.7, "8": 128.2})
    assert step_costs.floored({"1": 3.0, "5": 2.0, "9": 1.0}) == pytest.approx({"1": 3.0, "5": 3.0, "9": 3.0})


def lookup_acceptance_reference(token_ids, depths=10, max_ngram=3, tail=1024, prior=(), prior_weight=0.0,
                                min_match=1) -> list:
    """The definition, one position at a time: PromptLookup's first guess from dicts of n-grams
    (rounds start where its match is ``min_match`` tokens long or longer; 1: everywhere)."""
    ids = list(token_ids)
    last = [dict() for _ in range(max_ngram + 1)]  # n -> {n-gram: position that followed it}
    hit, starts = [], []
    for s in range(len(ids)):
        guess, matched = None, 0
        for n in range(min(max_ngram, s), 0, -1):
            follower = last[n].get(tuple(ids[s - n:s]))
            if follower is not None:
                guess, matched = ids[follower], n
                break
        if s >= len(ids) - tail:
            hit.append(guess == ids[s])
            starts.append(min_match <= 1 or matched >= min_match)  # (1: a position without a match is a miss)
        for n in range(1, min(max_ngram, s) + 1):
            last[n][tuple(ids[s - n:s])] = s
    q, runs = [], [t for t in range(len(hit)) if starts[t]]
    for d in range(depths):
        ok = [t for t in runs if t + d < len(hit) and hit[t + d]]
        valid = [t for t in runs if t + d < len(hit)]
        weight = prior_weight if prior else 0.0
        extra = weight * prior[min(d, len(prior) - 1)] if prior else 0.0
        q.append(round((len(ok) + extra) / (len(valid) + weight), 4) if valid or weight else 0.0)
        runs = ok
    return q


def test_lookup_acceptance_equals_its_definition():
    """The sorting implementation gives the position-by-position definition's rates: empty and
    tiny texts, 2-token to 300k-token vocabularies, repeated halves, every n-gram cap, priors,
    rounds from matches of 2 or 3 tokens only (a CPU's chains)."""
    rng = random.Random(0)
    for _ in range(300):
        n, vocab = rng.choice([0, 1, 2, 3, 4, 5, 10, 50, 300, 2000]), rng.choice([2, 3, 5, 50, 300000])
        ids = [rng.randrange(vocab) for _ in range(n)]
        if n > 20 and rng.random() < 0.5:
            ids = ids[:n // 2] * 2
        kw = dict(depths=rng.choice([1, 3, 10]), max_ngram=rng.choice([1, 2, 3, 4]), tail=rng.choice([1, 5, 1024]))
        if rng.random() < 0.3:
            kw.update(prior=[0.5, 0.3], prior_weight=8.0)
        if rng.random() < 0.5:
            kw.update(min_match=rng.choice([2, 3]))
        assert lookup_acceptance(ids, **kw) == lookup_acceptance_reference(ids, **kw), (n, vocab, kw)


def test_one_slow_round_does_not_keep_a_candidate_out():
    """A round measured far slower than the others (a hiccup of the host) does not move a
    candidate's round time (a median), and a candidate measured in few rounds is not predicted
    slower than the cost model says: plain rounds whose first rounds stalled still win the call."""
    from longspec.decoding.controller import Controller

    chain = TreeSpec.chain(5)
    c = Controller()
    assert c.begin({chain: (1.05, 1.5), None: (1.0, 1.2)}, "greedy") is None
    assert c.observe(1.0, 12e-3) is None  # a 12 ms plain round
    assert c.round_ms("plain") == pytest.approx(12.0) and c.candidates["plain"].ms == pytest.approx(1.2)
    c.observe(1.0, 12e-3)
    ran = [c.observe(1.0, 12e-3)]  # three stalls in a row: now the chain looks faster
    for _ in range(40):
        ran.append(c.observe(1.05 if ran[-1] is not None else 1.0, (1.5 if ran[-1] is not None else 1.2) / 1e3))
    assert set(ran[-20:]) == {None} and c.round_ms("plain") == pytest.approx(1.2)
    c.observe(1.0, 50e-3)  # later, one stall among settled rounds moves nothing
    assert c.round_ms("plain") == pytest.approx(1.2) and c.current.tree is None


def test_a_round_observed_late_counts_for_the_tree_that_ran_it():
    """A GPU's controller weighs a round while the next runs: a round observed after the
    controller chose another candidate counts for the one that ran it (its time, its tokens), and
    not towards the new candidate's rounds before another may take over."""
    from longspec.decoding.controller import Controller

    chain = TreeSpec.chain(5)
    c = Controller()
    assert c.begin({chain: (1.4, 1.4), None: (1.0, 1.2)}, "greedy") is None  # (a close call: plain timed first)
    for _ in range(3):
        chosen = c.observe(1.0, 1.2e-3, None)
    assert chosen == chain  # (plain rounds timed: the chain's 1.4 tokens in 1.4 ms win)
    c.observe(1.0, 5e-3, None)  # the plain round that ran while the controller chose the chain
    assert c.round_ms("plain") == pytest.approx(1.2) and c.candidates["plain"].rounds == 4
    assert c.candidates["chain:5"].rounds == 0 and c.dwell == 0
    c.observe(4.0, 1.5e-3, chain)
    assert c.candidates["chain:5"].rounds == 1 and c.round_ms("chain:5") == pytest.approx(1.5) and c.dwell == 1


def test_a_round_without_its_own_time_counts_its_tokens_only():
    """A round whose time is not its own (None: on a GPU a call's first round, or one that waited
    for a switch) adds its tokens and rounds, not a time: plain rounds timed at a call's start
    take one round more; the time of the candidate stays that of its own rounds, and a drift is
    found on timed rounds only."""
    from longspec.decoding.controller import Controller

    chain = TreeSpec.chain(5)
    c = Controller()
    assert c.begin({chain: (1.4, 1.4), None: (1.0, 1.2)}, "greedy") is None  # (plain timed first)
    assert c.observe(1.0, None) is None  # (the call's first round: launched from idle)
    assert c.round_ms("plain") is None and c.candidates["plain"].rounds == 1
    assert c.observe(1.0, 1.2e-3) is None and c.observe(1.0, 1.2e-3) is None  # two times: still timing
    assert c.observe(1.0, 1.2e-3) == chain  # three: the chain's 1.4 tokens in 1.4 ms win
    c.observe(1.0, None, None)  # the plain round in flight while the host switched
    assert c.round_ms("plain") == pytest.approx(1.2) and len(c.times["plain"]) == 3
    c.observe(4.0, None, chain)  # the chain's first round, after the rows were taken in
    assert c.candidates["chain:5"].rounds == 1 and c.round_ms("chain:5") is None
    for _ in range(3):
        c.observe(4.0, 1.4e-3, chain)
    assert c.round_ms("chain:5") == pytest.approx(1.4) and c.timed_in_call == {"plain": 3, "chain:5": 3}
    c.end()
    # the next call: the chain's first timed rounds, 1.5x slower, are a drift (untimed ones are not counted)
    c.begin({chain: (4.0, 1.4), None: (1.0, 1.2)}, "greedy")
    assert c.current.tree == chain
    c.observe(4.0, None)
    c.observe(4.0, 2.1e-3)
    c.observe(4.0, 2.1e-3)
    assert c.drift.followed is None  # (two timed rounds: not settled yet)
    c.observe(4.0, 2.1e-3)
    assert c.drift.followed is not None and c.round_ms("plain") == pytest.approx(1.8)


def test_a_slow_stretch_moves_every_time_for_its_call_then_back():
    """A call in which the device runs every round 1.5x slow: its first candidate to settle
    measures that, and every time measured before the call follows (plain rounds' too, which
    did not run), so the tree still beats plain rounds as it does at full speed (unscaled,
    its slow rounds would lose to plain rounds' old time). At its end every time is back at the
    usual speed (its rounds divided by 1.5), so the next call, the device back, starts right; a
    call that runs faster keeps its speed. A drift within DRIFT moves nothing; a transient in a
    call's first rounds alone is undone at its end, and so is a drift no later rounds confirm."""
    from longspec.decoding import controller
    from longspec.decoding.controller import Controller

    tree = TreeSpec.parse("2,2")
    predicted = {tree: (1.9, 1.5), None: (1.0, 1.0)}
    c = timed_plain(Controller(), 1.0)

    def call(ms: float, rounds: int = 10) -> list:
        assert c.begin(predicted, "t1") == tree
        chosen = [c.observe(1.9, ms / 1e3, tree) for _ in range(rounds)]
        c.end()
        return chosen

    call(1.5)
    assert c.round_ms("plain") == pytest.approx(1.0) and c.round_ms(str(tree)) == pytest.approx(1.5)
    assert c.begin(predicted, "t1") == tree
    assert {c.observe(1.9, 2.25e-3, tree) for _ in range(10)} == {tree}  # 1.9 tokens in 2.25 ms against 1 in 1.5
    assert c.round_ms("plain") == pytest.approx(1.5) and c.round_ms(str(tree)) == pytest.approx(2.25)
    c.end()
    assert c.round_ms("plain") == pytest.approx(1.0) and c.round_ms(str(tree)) == pytest.approx(1.5)
    assert c.drift.shaky == {str(tree)}  # (its time, taken back by one factor)
    call(1.35)  # 10% faster: within DRIFT
    assert c.round_ms("plain") == pytest.approx(1.0) and c.round_ms(str(tree)) == pytest.approx(1.35)
    assert not c.drift.shaky
    call(0.9)  # faster: kept (confirmed by the rounds after those that found it)
    assert c.round_ms("plain") == pytest.approx(1.0 * 0.9 / 1.35) and c.round_ms(str(tree)) == pytest.approx(0.9)
    assert c.begin(predicted, "t1") == tree  # a transient in the call's first rounds alone: undone at its end
    for ms in [1.35] * controller.SETTLED_ROUNDS + [0.9] * controller.TIME_WINDOW:
        c.observe(1.9, ms / 1e3, tree)
    assert c.round_ms("plain") == pytest.approx(1.0)
    c.end()
    assert c.round_ms("plain") == pytest.approx(1.0 * 0.9 / 1.35) and c.drift.shaky == {"plain"}  # (scaled, not measured)
    call(1.35, controller.SETTLED_ROUNDS)  # 1.5x slow in its first rounds, then nothing: unconfirmed
    assert c.round_ms("plain") == pytest.approx(1.0 * 0.9 / 1.35) and c.round_ms(str(tree)) == pytest.approx(0.9)


def test_a_drift_moves_only_the_times_as_old_as_its_candidates():
    """The call's first candidate to settle was last timed long ago: its drift says nothing of
    a candidate timed since (the tree of the last call), whose time stays."""
    from longspec.decoding import controller
    from longspec.decoding.controller import Controller

    tree, chain = TreeSpec.parse("2,2"), TreeSpec.chain(3)
    c = timed_plain(Controller(), 1.0)
    times, timed_at, called = c.records("t1")
    times["chain:3"], timed_at["chain:3"], called["chain:3"] = [2.0] * controller.SETTLED_ROUNDS, c.rounds, 1  # (a slow stretch, long ago)
    c.rounds += 100
    times[str(tree)], timed_at[str(tree)], called[str(tree)] = [1.5] * controller.SETTLED_ROUNDS, c.rounds, 5
    assert c.begin({chain: (3.0, 1.2), tree: (1.2, 1.5), None: (1.0, 1.0)}, "t1") == chain
    for _ in range(controller.SETTLED_ROUNDS):
        c.observe(2.0, 1.3e-3, chain)
    assert c.round_ms(str(tree)) == pytest.approx(1.5) and c.round_ms("plain") == pytest.approx(0.65)
    c.observe(2.0, 0.0, chain)  # (a zero time divides nothing)
    c.end()


def test_a_transient_in_a_calls_first_rounds_leaves_every_time_as_it_was():
    """The tree's first rounds in a call ran 2x slow, then plain rounds took over at their usual
    time (timed again: the drift moved theirs): nothing after those first rounds confirms the
    drift, so every time stays as it was and the tree, 20% faster, runs the next calls (divided
    by the first rounds' factor, plain rounds' true times had kept them out for good)."""
    from longspec.decoding.controller import Controller

    tree = TreeSpec.parse("2,2")
    c = timed_plain(Controller(), 1.0)

    def call(slow_rounds: int) -> list:
        ran = [c.begin({tree: (1.9, 1.5), None: (1.0, 1.0)}, "t1")]
        for i in range(30):
            ran.append(c.observe(1.0 if ran[-1] is None else 1.2, (2.0 if ran[-1] is not None and i < slow_rounds
                                                                   else 1.0) / 1e3, ran[-1]))
        c.end()
        return ran

    assert set(call(0)) == {tree}
    assert None in call(3)  # (the transient: plain rounds timed again, and run)
    assert c.round_ms("plain") == pytest.approx(1.0) and c.round_ms(str(tree)) == pytest.approx(1.0)
    assert not c.drift.shaky
    assert set(call(0)) == {tree}


def test_a_slow_call_of_plain_rounds_timed_again_is_taken_back_too():
    """A slow call begins with plain rounds timed again (their time old), then the tree finds the
    drift in its three rounds and gives way to plain rounds for the rest of the call: the drift is
    confirmed on plain rounds against their time before the call (dropped, not forgotten), and
    their slow rounds go back to the usual speed (kept, they made plain rounds look 1.5x dearer to
    every later call)."""
    from longspec.decoding import controller
    from longspec.decoding.controller import Controller

    tree = TreeSpec.parse("2,2")
    c = timed_plain(Controller(), 1.0)
    c.rounds += controller.RETIME_AFTER + 1
    times, timed_at, called = c.records("t1")
    times[str(tree)], timed_at[str(tree)], called[str(tree)] = [1.5] * controller.TIME_WINDOW, c.rounds, 1
    assert c.begin({tree: (1.8, 1.5), None: (1.0, 1.0)}, "t1") is None  # (plain rounds timed again first)
    ran = [None]
    for _ in range(30):
        ran.append(c.observe(1.0, (1.5 if ran[-1] is None else 2.25) / 1e3, ran[-1]))
    assert ran.count(tree) >= controller.SETTLED_ROUNDS and c.drift.followed is not None
    c.end()
    assert c.round_ms("plain") == pytest.approx(1.0) and c.round_ms(str(tree)) == pytest.approx(1.5)
    # but a time dropped as stale does not confirm alone what the drifted candidate's later rounds
    # deny: plain rounds 1.3x dearer than their old time (another context), the tree's first
    # rounds slow, its next ones as before: every time stays as measured
    c.rounds += controller.RETIME_AFTER + 1
    assert c.begin({tree: (1.8, 1.5), None: (1.0, 1.0)}, "t1") is None
    for ms, ran in [(1.3, None)] * 3 + [(2.0, tree)] * 3 + [(1.5, tree)] * 6 + [(1.3, None)] * 6:
        c.observe(1.0, ms / 1e3, ran)
    c.end()
    assert c.round_ms("plain") == pytest.approx(1.3) and c.round_ms(str(tree)) == pytest.approx(1.5)


def test_a_drift_moves_the_times_of_the_call_its_candidate_was_timed_in():
    """A process's first call ran slow (the device idling) and timed the tree, then plain
    rounds: in the next call, at full speed, the tree's drift brings plain rounds' time down too
    (timed in the same call; by their last round alone, later than the tree's, they kept the
    slow time, and a tree that pays less than plain rounds ran every later call)."""
    from longspec.decoding import controller
    from longspec.decoding.controller import Controller

    tree = TreeSpec.parse("2,2")
    predicted = {tree: (1.9, 1.5), None: (1.0, 1.0)}
    c = Controller()
    assert c.begin(predicted, "t1") == tree
    for _ in range(controller.SETTLED_ROUNDS):
        c.observe(1.9, 2.25e-3, tree)
    for _ in range(controller.TIME_WINDOW):
        c.observe(1.0, 1.5e-3, None)
    c.end()
    assert c.round_ms("plain") == pytest.approx(1.5) and c.round_ms(str(tree)) == pytest.approx(2.25)
    assert c.begin(predicted, "t1") == tree
    for _ in range(controller.SETTLED_ROUNDS):
        c.observe(2.0, 1.5e-3, tree)
    assert c.round_ms("plain") == pytest.approx(1.0)


def chain_after_a_slow_stretch(plain_ms: float, tokens: float, rounds: int) -> tuple:
    """(controller, trees run) of a call after a slow stretch left plain rounds at 1.78 ms and
    the chain at 1.65 (now 1.27): the chain makes ``tokens`` a round, plain rounds take
    ``plain_ms``."""
    from longspec.decoding import controller
    from longspec.decoding.controller import Controller

    chain = TreeSpec.chain(5)
    c = timed_plain(Controller(), plain_ms)
    times, timed_at, called = c.records("t1")
    c.calls, c.rounds = 3, 300
    for name, ms in (("plain", 1.78), ("chain:5", 1.65)):
        times[name], timed_at[name], called[name] = [ms] * controller.TIME_WINDOW, c.rounds, c.calls
    assert c.begin({chain: (1.6, 1.82), None: (1.0, 1.55)}, "t1") == chain
    ran = [chain]
    for _ in range(rounds):
        ran.append(c.observe(tokens if ran[-1] is not None else 1.0, (1.27 if ran[-1] is not None else plain_ms) / 1e3))
    return c, ran


def test_plain_rounds_are_timed_again_where_a_drift_leaves_the_choice_hanging_on_them():
    """A slow stretch slowed plain rounds more than the chain (1.53x against 1.3x): after it,
    the chain's drift brings plain rounds' time only part of the way back, and the chain, 7%
    slower than plain rounds, looked faster. Expected within RETIME_MARGIN of them once its own
    rounds count, it hands over to plain rounds, timed again, which keep the call."""
    c, ran = chain_after_a_slow_stretch(1.16, 1.04, 40)
    assert c.round_ms("plain") == pytest.approx(1.16) and set(ran[-20:]) == {None}


def test_plain_rounds_are_timed_again_once_a_call():
    """After a drift plain rounds are timed again where the choice hangs on them, once a call:
    found slower than the chain (3 rounds), they leave it to the chain for the rest of the call
    (timed again at every close round, they would cost the call a plain round in three)."""
    from longspec.decoding import controller

    c, ran = chain_after_a_slow_stretch(1.3, 1.1, 60)
    assert ran.count(None) == controller.SETTLED_ROUNDS and set(ran[-20:]) == {TreeSpec.chain(5)}
    assert c.round_ms("plain") == pytest.approx(1.3)


def test_plain_rounds_timed_in_a_slow_stretch_are_timed_again_where_the_choice_hangs_on_them():
    """A slow call slows the chain 1.3x, the tree 1.5x and plain rounds 1.6x: taken back to the
    usual speed by the median factor (1.5), plain rounds' time stays 7% slow. In the next call the
    chain, on a text it misses, is 5% slower than plain rounds but looked faster (and a drift
    of another kind of round, in between, says nothing of these): plain rounds' time, scaled, is
    timed again where the choice hangs on it, and plain rounds keep the call."""
    from longspec.decoding import controller
    from longspec.decoding.controller import Controller

    chain, tree = TreeSpec.chain(5), TreeSpec.parse("2,2")
    predicted = {chain: (1.6, 1.82), tree: (1.8, 2.36), None: (1.0, 1.55)}
    c = timed_plain(Controller(), 1.16)
    for kind, slow in (("t1", False), ("t1", True), ("greedy", False)):  # then greedy plain rounds alone
        c.begin(predicted, kind)
        for name, ms, tokens, factor in ((chain, 1.27, 1.5, 1.3), (tree, 1.53, 1.6, 1.5), (None, 1.16, 1.0, 1.6)):
            for _ in range(controller.TIME_WINDOW if kind == "t1" or name is None else 0):
                c.observe(tokens, ms * (factor if slow else 1.0) / 1e3, name)
        c.end()
    times = c.records("t1")[0]
    assert controller.median(times["plain"]) == pytest.approx(1.16 * 1.6 / 1.5)
    assert controller.median(times["chain:5"]) == pytest.approx(1.27 * 1.3 / 1.5)
    c.begin(predicted, "t1")
    ran = [c.current.tree]
    for _ in range(40):
        tokens = {None: 1.0, chain: 1.04}.get(ran[-1], 1.1)
        ran.append(c.observe(tokens, {None: 1.16, chain: 1.27}.get(ran[-1], 1.53) / 1e3))
    assert c.round_ms("plain") == pytest.approx(1.16) and set(ran[-20:]) == {None}
    c.end()
    assert "plain" not in c.drift.shaky


def test_plain_rounds_timed_long_ago_are_timed_again_where_the_choice_hangs_on_them():
    """Plain rounds timed slow (a process's first rounds, the device still idling) keep a tree
    that pays less than they do running; a call that begins long after (RETIME_AFTER rounds),
    with the tree predicted within RETIME_MARGIN of them, times them again first and keeps them.
    Where the tree is predicted clearly faster, its call starts with it."""
    from longspec.decoding import controller
    from longspec.decoding.controller import Controller

    tree = TreeSpec.parse("2,2")
    c = timed_plain(Controller(), 1.5)
    assert c.begin({tree: (1.9, 1.9), None: (1.0, 1.5)}, "t1") == tree  # (1.0 a ms against 0.67)
    for _ in range(controller.RETIME_AFTER + 1):
        assert c.observe(1.5, 2e-3, tree) == tree  # measured 0.75 tokens a ms: still above 0.67
    c.end()
    assert c.begin({tree: (1.9, 1.9), None: (1.0, 1.5)}, "t1") is None and c.round_ms("plain") is None
    ran = [c.observe(1.0, 1.2e-3, None) for _ in range(controller.SETTLED_ROUNDS + 5)]
    assert set(ran) == {None} and c.round_ms("plain") == pytest.approx(1.2)  # 0.83 a ms: plain rounds stay
    c.end()
    clear = Controller()
    times, timed_at, _ = clear.records("greedy")
    times["plain"], timed_at["plain"], clear.rounds = [1.5] * 3, 0, 1000
    assert clear.begin({tree: (6.0, 1.9), None: (1.0, 1.5)}, "greedy") == tree


def test_corrections_are_kept_for_the_next_process(tmp_path, monkeypatch):
    """What a controller learned about the cost model's predictions goes to its store after a
    call (other models' entries kept, an unreadable store ignored), and a new controller (the
    next ``longspec generate``) starts from it: here the chain that the prediction undervalued."""
    monkeypatch.setattr(corrections, "PRIOR_EXTRA", 0.0)  # (the sums below alone)
    from longspec.decoding import controller
    from longspec.decoding.controller import Controller

    store = tmp_path / "corrections.json"
    store.write_text("not json")
    chain, t1 = TreeSpec.chain(8), (1.0, 0, 1.0)
    predicted = {chain: (1.2, 1.5), None: (1.0, 1.2)}  # 0.8 tokens a ms: plain rounds look faster
    first = timed_plain(Controller(str(store), "model A"), 1.2)
    assert first.begin(predicted, "greedy") is None
    first.current = first.candidates["chain:8"]  # (as if the text had made it run)
    for _ in range(10):
        first.observe(6.0, 1.5e-3)
    first.end()
    assert json.loads(store.read_text())["model A"]
    nxt = timed_plain(Controller(str(store), "model A"), 1.2)
    assert nxt.begin(predicted, "greedy") == chain  # 1 + 0.2 x min(5 / 0.2, MAX_CORRECTION) tokens
    assert nxt.candidates["chain:8"].prior == pytest.approx(1 + 0.2 * controller.MAX_CORRECTION)
    assert nxt.learned.calls[("chain", "greedy")] == 1  # (the calls that measured it: a probe's rule)
    assert nxt.begin(predicted, t1) is None  # (nothing learned at temperature 1)
    assert timed_plain(Controller(str(store), "model B"), 1.2).begin(predicted, "greedy") is None
    other = Controller(str(store), "model B")
    other.begin(predicted, t1)
    other.observe(1.0, 1e-3)
    other.end()
    assert set(json.loads(store.read_text())) == {"model A", "model B"}


def test_lookup_index_predicts_as_the_whole_texts_sort():
    """The prompt's index predicts what lookup_predictions does on the whole text, on the prompt
    and on what follows it, with the lengths of the matches (texts that repeat much or not at all,
    continuations that copy the prompt, vocabularies of 2 to 50,000, prompts shorter than an
    n-gram)."""
    import numpy as np

    from longspec.spec.acceptance import LookupIndex, lookup_predictions

    rng = random.Random(0)
    for trial in range(300):
        vocab, p, t = rng.choice([2, 3, 5, 20, 50000]), rng.randint(1, 300), rng.randint(0, 80)
        ids = [rng.randrange(vocab) for _ in range(p + t)]
        if rng.random() < 0.3:
            start = rng.randrange(p)
            ids = ids[:p] + (ids[start:p] * 80)[:t]
        index, whole = LookupIndex(ids[:p]), lookup_predictions(np.asarray(ids), 3, lengths=True)
        guess, matched = index.predictions(ids, lengths=True)
        assert (guess == whole[0][p:]).all() and (matched == whole[1][p:]).all(), (trial, vocab, p, t)
        assert (index.predictions(ids) == guess).all()
        prompt = lookup_predictions(np.asarray(ids[:p]), 3, lengths=True)
        assert (index.prompt_guess == prompt[0]).all() and (index.prompt_matched == prompt[1]).all()
        tail, min_match = rng.randint(1, max(t, 1)), rng.choice([1, 2])
        assert lookup_acceptance(ids, tail=tail, index=index if t else LookupIndex(ids), min_match=min_match) == \
            lookup_acceptance(ids, tail=tail, min_match=min_match)
    # a long generation (its gained part sorted, not compared pairwise: that grew with its square)
    ids = [rng.randrange(50) for _ in range(3000)]
    assert (LookupIndex(ids[:1000]).predictions(ids) == lookup_predictions(np.asarray(ids), 3)[1000:]).all()


def test_a_store_that_cannot_be_written_is_not_an_error(tmp_path):
    """A controller whose store cannot be written (a read-only home) still learns in memory."""
    from longspec.decoding.controller import Controller

    blocked = tmp_path / "file"
    blocked.write_text("")
    chain = TreeSpec.chain(8)
    c = timed_plain(Controller(str(blocked / "corrections.json"), "model"), 1.0)  # (a folder that is a file)
    c.begin({chain: (2.0, 1.0), None: (1.0, 1.0)}, "greedy")
    c.observe(5.0, 1e-3)
    c.end()
    assert c.learned.pairs[("chain", "greedy")] == (4.0, 1.0)
    # a store of another shape, or with entries this version cannot read, is learned again
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({"model": {"not json": [1, 2], json.dumps(["chain:8", "greedy"]): "x"}, "other": 3}))
    assert Controller(str(odd), "model").learned.pairs == {} and Controller(str(odd), "other").learned.pairs == {}


def test_an_auto_call_reports_its_speed_against_plain_rounds_and_keeps_its_corrections(tiny, tmp_path, monkeypatch):
    """``Generator(proposer="auto")``: the same tokens as plain decoding; its stats say where the
    time went, its decoding against plain rounds' (as its controller timed or predicted them) and
    its switches (null: plain rounds); what it learned is kept in the home for the next process."""
    from longspec import GenerationConfig
    from longspec.decoding import controller
    from longspec.decoding.generator import Generator

    monkeypatch.setenv("LONGSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(controller, "RETIME_MARGIN", float("inf"))  # (plain rounds timed first, whatever they cost)
    target, draft = tiny
    draft.config.acceptance = [[0.5, 0.6, 0.7, 0.8, 0.9, 0.99]]
    prompt = torch.randint(0, 160, (40,), generator=torch.Generator().manual_seed(8)).tolist() * 3
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    out = Generator(target, proposer="auto", draft=draft).generate([prompt], config)
    assert out.sequences == Generator(target).generate([prompt], config).sequences
    stats = out.stats
    assert stats["vs_plain"] > 0 and stats["host_s"] >= 0 and stats["plan_s"] > 0 and stats["trees"]
    assert stats["trees"][0][1] is None  # (the plain rounds first)
    assert 0 < stats["rounds_s"] <= stats["decode_s"] and stats["cached_tokens"] == 0
    assert all(tree is None or isinstance(tree, str) for _, tree in stats["trees"])
    assert json.loads((tmp_path / "corrections.json").read_text())


def test_auto_makes_its_plan_while_the_device_prefills(tiny, tmp_path, monkeypatch):
    """Once its step costs are measured, ``Generator(proposer="auto")`` makes a call's plan after
    launching the prefill and before waiting for it (a GPU's prefill then hides it), the row
    joining plain rounds, its first tree taken up after: plain decoding's tokens. A plan that
    fails there leaves the engine empty for the next call."""
    from longspec import GenerationConfig
    from longspec.decoding.generator import Generator

    monkeypatch.setenv("LONGSPEC_HOME", str(tmp_path))
    target, draft = tiny
    draft.config.acceptance = [[0.5, 0.6, 0.7, 0.8, 0.9, 0.99]]
    rng = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 160, (30 + 7 * i,), generator=rng).tolist() * 3 for i in range(3)]
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    gen, plain = Generator(target, proposer="auto", draft=draft), Generator(target)
    gen.generate([prompts[0]], config)  # (measures the step costs, then plans first)
    made, plan = [], gen.plan

    def planned(prompts, config):
        engine = gen._engine
        made.append((int(engine.cache.lengths[0]), engine.has_active))  # (prefilled, not yet a row)
        return plan(prompts, config)

    monkeypatch.setattr(gen, "plan", planned)
    out = gen.generate([prompts[1]], config)
    assert made == [(len(prompts[1]), False)]
    assert out.sequences == plain.generate([prompts[1]], config).sequences
    assert out.stats["plan_s"] > 0 and out.stats["trees"][0][0] == 0 and out.stats["auto"].startswith("cost model")
    one = GenerationConfig(max_new_tokens=1)  # (the row is done at its first token: no rounds, no switch)
    assert gen.generate([prompts[1]], one).sequences == plain.generate([prompts[1]], one).sequences
    monkeypatch.setattr(gen, "plan", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        gen.generate([prompts[2]], config)
    engine = gen._engine
    assert not engine.has_active and engine.cache.allocator.num_free == engine.pool.num_blocks
    monkeypatch.setattr(gen, "plan", plan)
    assert gen.generate([prompts[2]], config).sequences == plain.generate([prompts[2]], config).sequences


def test_auto_takes_a_row_in_for_its_first_tree_before_reading_its_first_token(tiny, tmp_path, monkeypatch):
    """auto's plan and its controller's first choice are made while the device prefills, and the
    proposer then takes the row in for that tree once, with the first token still on the device
    (a GPU queues that work behind the prefill instead of waiting for it): no switch follows."""
    from longspec import GenerationConfig
    from longspec.decoding import controller
    from longspec.engine.engine import Engine
    from longspec.decoding.generator import Generator

    monkeypatch.setenv("LONGSPEC_HOME", str(tmp_path))
    target, draft = tiny
    draft.config.acceptance = [[0.5, 0.6, 0.7, 0.8, 0.9, 0.99]]
    prompt = torch.randint(0, 160, (40,), generator=torch.Generator().manual_seed(3)).tolist() * 3
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    labels = [f"hybrid chain:{n}" for n in auto.LOOKUP_CHAINS] + [f"hybrid {t}" for t in auto.AUTO_TREES]
    sizes = {str(TreeSpec.parse(label.split()[1]).num_nodes) for label in labels} | {"1"}
    fake_costs(target, tmp_path / "costs.json", len(prompt), {m: 1.0 for m in sizes}, {label: 0.01 for label in labels})
    gen = Generator(target, proposer="auto", draft=draft, max_len=240)  # (an engine, and controller, of its own)
    # (plain rounds timed, and no other round observed: the first choice then rests on the costs
    # alone, not on what a loaded machine measured of a tree's rounds; a call's last round is not)
    gen.generate([prompt], GenerationConfig(max_new_tokens=2 + controller.SETTLED_ROUNDS, ignore_eos=True))
    taken, switched, take_in, use_tree = [], [], Engine.take_in, Engine.use_tree

    def record_take_in(engine, row, text, last, tree):
        taken.append((torch.is_tensor(last), tree, int(engine.active[row])))
        return take_in(engine, row, text, last, tree)

    def record_use_tree(engine, tree):
        switched.append((tree, engine.has_active))
        return use_tree(engine, tree)

    monkeypatch.setattr(Engine, "take_in", record_take_in)
    monkeypatch.setattr(Engine, "use_tree", record_use_tree)
    out = gen.generate([prompt], config)
    first = out.stats["trees"][0]
    assert first[0] == 0 and first[1] is not None, out.stats["auto"]  # (a tree first: the prompt repeats itself)
    assert taken[0] == (True, TreeSpec.parse(first[1]), 0)  # (the row decodes after it)
    assert sum(active for _, active in switched) == len(out.stats["trees"]) - 1  # (the switches while generating)


def test_a_plan_reads_the_prompts_last_tokens_only(tiny, tmp_path, monkeypatch):
    """auto's plan predicts the lookup's hits from the prompt's last PLAN_WINDOW tokens, and so do
    its re-predictions while generating: a long prompt's plan equals its recent part's."""
    target, draft = tiny
    draft.config.acceptance = [[0.5, 0.6, 0.7, 0.8, 0.9, 0.99]]
    monkeypatch.setattr(auto, "PLAN_WINDOW", 64)
    monkeypatch.setattr(step_costs, "measure_costs", lambda *a, **k: pytest.fail("costs were cached"))
    costs = tmp_path / "costs.json"
    rng = random.Random(4)
    head, recent = [rng.randrange(160) for _ in range(100)], [rng.randrange(20) for _ in range(64)]
    fake_costs(target, costs, 164, {str(m): 1.0 for m in range(1, 80)},
               {label: 0.5 for label in auto._candidates([], draft, [])})
    long, short = (resolve(target, ids, draft, costs_file=str(costs)) for ids in (head + recent, recent))
    assert {t: p[0] for t, p in long.predicted.items()} == {t: p[0] for t, p in short.predicted.items()}
    assert long.hits == short.hits and long.hits != resolve(target, head[-64:], draft, costs_file=str(costs)).hits
    generated = recent[10:30]
    assert long.repredict(head + recent + generated, 164) == short.repredict(recent + generated, 64)
    # the same text again (another sample of the same request) is not indexed again
    made, index = [], auto.LookupIndex
    monkeypatch.setattr(auto, "LookupIndex", lambda ids: made.append(len(ids)) or index(ids))
    again = resolve(target, [7] + recent, draft, costs_file=str(costs))
    assert made == [] and again.hits == long.hits and again.index is long.index
    assert resolve(target, recent + [7], draft, costs_file=str(costs)).index is not long.index and made == [64]


def test_an_error_while_weighing_a_round_leaves_the_engine_usable(tiny):
    """A controller that raises while the device runs the next round (a GPU's way), or a Ctrl-C
    while the host waits for a round with another launched ahead of it: the call fails, every
    round in flight is finished, and the shared engine serves the next call."""
    from longspec import GenerationConfig
    from longspec.decoding.generator import Generator
    from longspec.spec.proposers import PromptLookup

    target, _ = tiny
    prompt = torch.randint(0, 160, (40,), generator=torch.Generator().manual_seed(12)).tolist() * 2
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True)

    class Failing(Scripted):
        def observe(self, tokens, seconds, tree):
            raise KeyboardInterrupt

    gen = Generator(target, PromptLookup(), TreeSpec.chain(4), controller=Failing(TreeSpec.chain(4), []))
    gen.launch_ahead = True
    with pytest.raises(KeyboardInterrupt):
        gen.generate([prompt], config)
    engine = gen._engine
    assert not engine.in_flight and not engine.has_active
    again = Generator(target, gen.proposer, TreeSpec.chain(4))  # (the same proposer and tree: the same engine)
    assert again.generate([prompt], config).sequences == Generator(target).generate([prompt], config).sequences
    assert again._engine is engine
    # Ctrl-C while waiting for a round, with another launched ahead of it: both are finished
    from longspec.engine.engine import Engine

    real, calls = Engine.finish, []

    def interrupted(engine, streamer=None):
        calls.append(engine.in_flight)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(engine, streamer)

    again.launch_ahead = True
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Engine, "finish", interrupted)
        with pytest.raises(KeyboardInterrupt):
            again.generate([prompt], config)
    assert calls[2] == 2 and not engine.in_flight and not engine.has_active
    assert again.generate([prompt], config).sequences == Generator(target).generate([prompt], config).sequences


def test_a_cheap_candidate_whose_correction_rests_on_few_calls_is_probed_once(monkeypatch):
    """A correction learned in one call (a lookup that hit little on that prompt) would keep a
    cheap candidate out of every later call at that setting: while fewer than PROBE_CALLS calls
    measured it, a candidate whose rounds cost at most PROBE_COST plain ones and whose uncorrected
    prediction is the fastest by CLEAR_MARGIN runs once in a call; its own rounds then decide (it
    stays where it hits, leaves where it does not, and is not probed again in that call). An
    expensive tree is not probed, nor a candidate measured in enough calls."""
    monkeypatch.setattr(corrections, "PRIOR_EXTRA", 0.0)  # (the sums below alone)
    from longspec.decoding import controller
    from longspec.decoding.controller import Controller

    chain, tree, t07 = TreeSpec.chain(5), TreeSpec.parse("4,4,1"), (0.7, 0, 0.9)
    predicted = {chain: (2.0, 1.25), tree: (4.0, 2.6), None: (1.0, 1.0)}  # (the tree: 1.5 tokens a ms hoped)
    c = timed_plain(Controller(), 1.0)
    times, *_ = c.records("truncated")  # (their rounds measured in an earlier call)
    times["chain:5"], times["4,4,1"] = [1.25] * 3, [2.6] * 3
    c.learned.pairs[("chain", t07)] = c.learned.pairs[("4,4,1", t07)] = (0.1, 2.0)  # (one call: 0.05 of the extra tokens)
    c.learned.calls[("chain", t07)] = c.learned.calls[("4,4,1", t07)] = 1
    assert c.begin(predicted, t07) is None  # (corrected: 1.2 tokens in 1.25 ms)
    ran = [c.observe(1.0, 1e-3)]
    assert ran == [chain]  # probed: 2 tokens in 1.25 ms hoped
    for _ in range(10):
        ran.append(c.observe(*((4.0, 1.25e-3) if ran[-1] == chain else (1.0, 1e-3))))
    assert set(ran) == {chain}  # it hits: it stays
    c.end()
    assert c.learned.calls[("chain", t07)] == 2
    # where it does not hit, plain rounds are back within a few rounds, and it is not probed again
    c.learned.pairs[("chain", t07)], c.learned.calls[("chain", t07)] = (0.1, 2.0), 1
    c.begin(predicted, t07)
    ran = [c.observe(1.0, 1e-3)]
    for _ in range(30):
        ran.append(c.observe(*((1.0, 1.25e-3) if ran[-1] == chain else (1.0, 1e-3))))
    assert ran[0] == chain and ran.count(chain) <= controller.DWELL + 1 and set(ran[-20:]) == {None}
    # measured in PROBE_CALLS calls: no probe; nor of a tree whose rounds cost 2.6 plain ones
    c.end()
    c.learned.pairs[("chain", t07)] = (0.1, 2.0)
    c.begin(predicted, t07)
    assert {c.observe(1.0, 1e-3) for _ in range(10)} == {None}
    # of two cheap candidates to probe, the one whose uncorrected prediction is fastest
    cheap = TreeSpec.parse("2,2")
    c = timed_plain(Controller(), 1.0)
    times, *_ = c.records("truncated")
    for name, ms in (("chain:5", 1.25), ("2,2", 1.4)):
        learned = corrections.learned_as(name), t07
        c.learned.pairs[learned], c.learned.calls[learned], times[name] = (0.1, 2.0), 1, [ms] * 3
    c.begin({chain: (2.0, 1.25), cheap: (3.0, 1.4), None: (1.0, 1.0)}, t07)
    assert c.observe(1.0, 1e-3) == cheap
    # a candidate whose round time is only predicted (a new process) is not probed: a probe's cost
    # is bounded by a measured time ...
    c = timed_plain(Controller(), 1.0)
    c.learned.pairs[("2,2", t07)], c.learned.calls[("2,2", t07)] = (0.1, 2.0), 1
    c.time_probed.add("truncated")  # (the trees' probe for their time spent: see the test below)
    c.begin({cheap: (3.0, 1.4), None: (1.0, 1.0)}, t07)
    assert {c.observe(1.0, 1e-3) for _ in range(10)} == {None}
    # ... or by its prediction calibrated by another tree's measured rounds at this kind of round
    # alone (not by a chain's, nor by plain rounds': the cost model scales alike only within a kind)
    wide = TreeSpec.parse("4,8")
    for measured, vouches in (({"chain:5": 2.4}, False), ({"4,8": 2.4}, True),
                              ({"chain:5": 2.0, "4,8": 4.0}, False)):  # (the tree 2x its prediction: 2.4 ms)
        c = timed_plain(Controller(), 1.0)
        c.learned.pairs[("2,2", t07)], c.learned.calls[("2,2", t07)] = (0.1, 2.0), 1
        for other, ms in measured.items():
            c.records("truncated")[0][other] = [ms] * 3  # (1.2x what the cost model said, unless said)
        c.begin({cheap: (3.0, 1.2), chain: (1.1, 2.0), wide: (1.2, 2.0), None: (1.0, 1.0)}, t07)
        assert (c.observe(1.0, 1e-3) == cheap) is vouches, measured


def test_a_near_tie_with_plain_rounds_does_not_leave_them():
    """A candidate predicted within SWITCH_MARGIN of plain rounds does not take over from them,
    at a call's start or while generating (a switch's host work would cost more than it gains);
    one predicted clearly faster does."""
    from longspec.decoding import controller
    from longspec.decoding.controller import Controller

    chain = TreeSpec.chain(5)
    near = 1.0 + (controller.SWITCH_MARGIN - 1.0) / 2
    c = timed_plain(Controller(), 1.0)
    assert c.begin({chain: (near, 1.0), None: (1.0, 1.0)}, "greedy") is None and c.planned.tree == chain
    assert {c.observe(1.0, 1e-3) for _ in range(3 * controller.DWELL)} == {None}
    clear = 1.0 + (controller.SWITCH_MARGIN - 1.0) * 2
    assert c.begin({chain: (clear, 1.0), None: (1.0, 1.0)}, "greedy") == chain


def test_a_candidates_measured_share_is_not_lifted_by_anothers_rounds():
    """Within a call a candidate that ran expects no more than its own rounds made of its
    prediction, and another candidate's better rounds do not lift it back (they would make the
    two take turns, each switch costing host work); an untried one expects the pooled share."""
    from longspec.decoding import controller
    from longspec.decoding.controller import Controller

    tree, chain, other = TreeSpec.parse("4,4,1"), TreeSpec.chain(5), TreeSpec.parse("2,2")
    c = timed_plain(Controller(), 1.0)
    c.begin({tree: (3.0, 2.0), chain: (2.0, 1.2), other: (2.5, 1.6), None: (1.0, 1.0)}, "greedy")
    c.current = c.candidates["4,4,1"]
    for _ in range(2 * controller.SETTLED_ROUNDS):
        c.observe(1.8, 2e-3, tree)  # 0.4 of its 2 extra tokens
    assert c.candidates["4,4,1"].prior == pytest.approx(1.8) and c.candidates["2,2"].prior == pytest.approx(1.6)
    c.current = c.candidates["chain:5"]
    for _ in range(2 * controller.SETTLED_ROUNDS):
        c.observe(2.0, 1.2e-3, chain)  # all of its extra token
    assert c.candidates["4,4,1"].prior == pytest.approx(1.8)
    assert c.candidates["chain:5"].prior == pytest.approx(2.0) and c.candidates["2,2"].prior > 1.6


def test_auto_near_the_context_end_runs_plain_rounds_in_its_own_engine(tiny, tmp_path, monkeypatch):
    """A prompt that leaves room for plain decoding but for no speculative tree: auto runs plain
    rounds in the engine its other calls use (its graphs captured already, no second KV pool),
    the row holding room for plain rounds only (no tree may then run: refused); plain decoding's
    tokens; the next call speculates again."""
    from longspec import GenerationConfig
    from longspec.engine.engine import Sequence
    from longspec.decoding.generator import Generator

    monkeypatch.setenv("LONGSPEC_HOME", str(tmp_path))
    target, draft = tiny
    draft.config.acceptance = [[0.5, 0.6, 0.7, 0.8, 0.9, 0.99]]
    limit, config = 192, GenerationConfig(max_new_tokens=8, ignore_eos=True)
    gen, plain = Generator(target, proposer="auto", draft=draft, max_len=limit), Generator(target, max_len=limit)
    rng = torch.Generator().manual_seed(13)
    short = torch.randint(0, 160, (30,), generator=rng).tolist() * 2
    gen.generate([short], config)
    engine = gen._engine
    assert engine.tree.num_nodes > 5
    near = torch.randint(0, 160, (limit - config.max_new_tokens - 3,), generator=rng).tolist()
    out = gen.generate([near], config)
    assert out.sequences == plain.generate([near], config).sequences
    assert gen._engine is engine and "no room" in out.stats["auto"] and out.stats["tau"] == 1.0
    seq = Sequence(near, config.max_new_tokens, plain_rounds=True)
    with torch.inference_mode():
        engine.use_tree(TreeSpec.chain(2))
        with pytest.raises(ValueError, match="plain rounds only"):
            engine.add([seq])
        engine.use_tree(None)
        engine.add([seq])
        with pytest.raises(ValueError, match="plain rounds only"):
            engine.use_tree(TreeSpec.chain(2))
        engine.cancel(seq)
    assert gen.generate([short], config).sequences == plain.generate([short], config).sequences


def test_an_untried_candidate_takes_the_pooled_correction_of_its_kind(monkeypatch):
    """A tree no call measured yet at a sampling setting starts from the correction the draft's
    other trees learned there (at temperature 1 the draft's every tree hits less than its greedy
    table says), not from the cost model alone; the lookup's chain keeps its own (none)."""
    monkeypatch.setattr(corrections, "PRIOR_EXTRA", 0.0)  # (the sums below alone)
    from longspec.decoding.controller import Controller

    big, small, chain, t1 = TreeSpec.parse("4,4,1"), TreeSpec.parse("2,2"), TreeSpec.chain(5), (1.0, 0, 1.0)
    c = timed_plain(Controller(), 1.0)
    c.learned.pairs[("2,2", t1)] = (0.6, 2.0)  # (0.3 of its extra tokens came)
    assert c.begin({big: (4.4, 2.0), small: (3.0, 1.5), chain: (1.2, 1.2), None: (1.0, 1.0)}, t1) is None
    assert c.candidates["4,4,1"].prior == pytest.approx(1.0 + 3.4 * 0.3)
    assert c.candidates["chain:5"].prior == pytest.approx(1.2)
    assert c.begin({big: (4.4, 2.0), small: (3.0, 1.5), None: (1.0, 1.0)}, "greedy") == big  # (another setting)


def test_every_chain_length_learns_one_correction(tmp_path):
    """The lookup's chains share what they learned (one lookup on one text; a CPU's step costs
    pick the length): a chain of 3 starts from what the chain of 7 measured, and a store of an
    older version, a key per chain length, is read as one entry; trees keep their own."""
    from longspec.decoding.controller import Controller

    store = tmp_path / "corrections.json"
    entry = lambda name, pair: (json.dumps([name, "greedy"]), [*pair, 3])  # noqa: E731
    store.write_text(json.dumps({"m": dict([entry("chain:7", (3.0, 2.0)), entry("chain:5", (1.0, 2.0)),
                                            entry("2,2", (1.0, 4.0))])}))
    c = timed_plain(Controller(str(store), "m"), 1.0)
    assert c.learned.pairs[("chain", "greedy")] == (4.0, 4.0) and c.learned.calls[("chain", "greedy")] == 6
    k = corrections.PRIOR_EXTRA  # (every correction's sums start from k extra tokens as predicted)
    assert c.learned.of("chain:3", "greedy") == 1.0 and c.learned.of("2,2", "greedy") == (1 + k) / (4 + k)
    c.learned.fold("chain:3", "greedy", 0.0, 4.0)
    assert c.learned.of("chain:7", "greedy") == pytest.approx((2 + k) / (6 + k))  # (earlier sums decayed by half)
    # a few rounds of one call that made none of their extra tokens: not the least correction
    c.learned.fold("2,2", "t1", 0.0, 4.0)
    assert c.learned.of("2,2", "t1") == pytest.approx(k / (4 + k)) and k / (4 + k) > 0.6


def test_a_trees_shortfall_does_not_lower_an_untried_chain():
    """A tree that made few of its predicted extra tokens lowers the untried trees' priors (the
    draft misses this text), not the lookup chain's, which reads the text's repeats; a chain's
    shortfall lowers the trees' too (their predictions count the lookup's hits). But a hybrid
    tree at least as deep as the chain holds it as one of its paths: the chain expects no more
    than that tree made, and plain rounds, not the chain, take over from it."""
    from longspec.decoding.controller import Controller

    tree, other, chain = TreeSpec.parse("4,4,1"), TreeSpec.parse("2,2"), TreeSpec.chain(5)
    c = timed_plain(Controller(), 1.0)
    assert c.begin({tree: (4.0, 1.5), other: (3.0, 1.4), chain: (3.0, 1.3), None: (1.0, 1.0)}, "greedy") == tree
    for _ in range(4):
        c.observe(1.0, 1.5e-3, tree)  # (none of its 3 extra tokens)
    assert c.candidates["2,2"].prior == 1.0 and c.candidates["chain:5"].prior == 3.0
    c = timed_plain(Controller(), 1.0)
    c.begin({tree: (4.0, 1.5), chain: (3.0, 1.3), None: (1.0, 1.0)}, "greedy")
    for _ in range(4):
        c.observe(1.0, 1.3e-3, chain)
    assert c.candidates["4,4,1"].prior == 1.0
    deep = TreeSpec.parse("4,4,1,1,1")
    c = timed_plain(Controller(), 1.0)
    assert c.begin({deep: (4.0, 1.5), chain: (2.0, 1.1), None: (1.0, 1.0)}, "greedy") == deep
    ran = [deep]
    for _ in range(20):
        ran.append(c.observe(1.1 if ran[-1] is not None else 1.0, (1.5 if ran[-1] is not None else 1.0) / 1e3))
    assert chain not in ran and set(ran[-10:]) == {None}
    assert c.candidates["chain:5"].prior == pytest.approx(1.1) and c.candidates["chain:5"].hoped == pytest.approx(1.1)


def test_plain_rounds_take_over_from_a_candidate_a_little_slower():
    """A candidate that turns out a few percent slower than plain rounds (less than the margin
    another candidate needs to take over) gives way to them within a few rounds: a call must not
    be slower than plain decoding."""
    from longspec.decoding import controller
    from longspec.decoding.controller import Controller

    tree = TreeSpec.parse("4,4,1")
    c = timed_plain(Controller(), 1.0)
    assert c.begin({tree: (2.6, 2.0), None: (1.0, 1.0)}, (1.0, 0, 1.0)) == tree  # (1.3 tokens a ms predicted)
    ran = [tree]
    for _ in range(40):
        ran.append(c.observe(*((1.9, 2e-3) if ran[-1] == tree else (1.0, 1e-3))))  # 0.95 tokens a ms
    assert ran.count(tree) <= 2 * controller.SETTLED_ROUNDS + controller.DWELL and set(ran[-20:]) == {None}


def test_a_tree_may_take_over_from_a_chain_whose_rounds_draft_nothing():
    """A CPU's lookup chain that finds no match runs decode steps, observed as plain rounds: they
    do not hand the call to plain rounds (the chain's own rounds decide that), but a tree now
    expected clearly faster takes over as it would after the chain's own round."""
    from longspec.decoding.controller import Controller

    chain, tree = TreeSpec.chain(7), TreeSpec.parse("4,4,4,4,4,1,1,1,1,1")
    c = timed_plain(Controller(offset=True), 60.0)
    assert c.begin({chain: (2.5, 100.0), tree: (2.0, 150.0), None: (1.0, 60.0)}, "greedy") == chain
    assert c.observe(1.0, 0.055, None) == chain  # (plain rounds a little faster than before: kept)
    assert c.candidates["plain"].rounds == 1 and c.candidates["chain:7"].rounds == 0
    c.repredict({tree: 6.0})  # (the generated text now suits the tree: 1.6x the chain's rate)
    assert c.observe(1.0, 0.06, None) == tree


def test_a_candidate_that_gave_way_runs_again_once_where_the_generated_text_repeats():
    """A chain that hit nothing in a call's first rounds gives way to plain rounds; when the
    lookup's prediction on the text generated since says far more (a chat answer quoting the
    code), it runs again, once a call: its new rounds decide, and the call's correction counts
    all its rounds."""
    from longspec.decoding.controller import Controller

    chain, t07 = TreeSpec.chain(5), (0.7, 0, 0.9)
    c = timed_plain(Controller(), 1.0)
    c.learned.pairs[("chain", t07)], c.learned.calls[("chain", t07)] = (2.0, 2.0), 3  # (as predicted, in 3 calls)
    assert c.begin({chain: (2.0, 1.2), None: (1.0, 1.0)}, t07) == chain
    ran = [chain]
    for _ in range(20):
        ran.append(c.observe(*((1.0, 1.2e-3) if ran[-1] == chain else (1.0, 1e-3))))
    assert set(ran[-10:]) == {None} and c.wants_predictions()
    first = ran[:-1].count(chain)  # (its rounds)
    c.repredict({chain: 1.05})  # (a little more than it made: its rounds stand)
    assert c.observe(1.0, 1e-3) is None and not c.candidates["chain:5"].retried
    c.repredict({chain: 4.0})
    ran = [c.observe(1.0, 1e-3)]
    for _ in range(10):
        ran.append(c.observe(*((4.0, 1.2e-3) if ran[-1] == chain else (1.0, 1e-3))))
    assert set(ran) == {chain} and not c.wants_predictions()
    c.end()  # (every round it ran counts: first + 10, of which 10 made 3 extra tokens)
    assert c.learned.pairs[("chain", t07)] == pytest.approx((corrections.LEARNED_DECAY * 2.0 + 30.0,
                                                          corrections.LEARNED_DECAY * 2.0 + first + 10))


def test_round_times_are_kept_per_kind_of_round():
    """A round's time depends on its kind (greedy, sampled, truncated: top-k / top-p work on
    every node): a tree timed in truncated rounds is weighed by that time in truncated calls
    only; a greedy call weighs it by the cost model's prediction, scaled as the greedy rounds
    measured scale."""
    from longspec.decoding.controller import Controller, round_kind

    assert [round_kind(s) for s in ((0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 0, 0.9), (1.0, 20, 1.0))] == \
        ["greedy", "sampled", "truncated", "truncated"]
    tree, t07, greedy = TreeSpec.parse("4,4,1"), (0.7, 0, 0.9), (0.0, 0, 1.0)
    predicted = {tree: (4.0, 2.0), None: (1.0, 1.0)}
    c = timed_plain(Controller(), 1.0)
    assert c.begin(predicted, t07) == tree
    for _ in range(10):
        c.observe(4.0, 3e-3)
    c.end()
    assert c.candidates["4,4,1"].ms == pytest.approx(3.0)
    c.begin(predicted, greedy)
    assert c.candidates["4,4,1"].ms == pytest.approx(2.0) and c.round_ms("4,4,1") is None
    c.end()
    c.begin(predicted, t07)
    assert c.candidates["4,4,1"].ms == pytest.approx(3.0)


def test_on_a_cpu_unmeasured_round_times_are_offset_not_scaled():
    """On a CPU the cost model times the engine's own eager steps and a round adds the same host
    work to each: an unmeasured candidate's time is its prediction plus what plain rounds took
    beyond theirs; on a GPU (compiled graphs against uncompiled steps) scaled in proportion."""
    from longspec.decoding.controller import Controller

    chain = TreeSpec.chain(8)
    predicted = {chain: (1.5, 2.0), None: (1.0, 1.0)}
    for offset, expected in ((True, 2.2), (False, 2.4)):
        c = timed_plain(Controller(offset=offset), 1.2)
        c.begin(predicted, "greedy")
        assert c.candidates["chain:8"].ms == pytest.approx(expected)


def test_auto_on_a_cpu_offsets_its_predictions(tiny):
    from longspec.decoding.shared import new_controller

    target, draft = tiny
    assert target.device.type == "cpu" and new_controller(target, draft).offset


def test_a_tree_that_gave_way_returns_only_on_a_prediction_above_the_one_it_ran_with():
    """A tree's prediction is mostly the draft's acceptance, the same as when its rounds failed
    (at temperature 1 on an answer the draft does not predict): the same expectation again does
    not bring it back (it would repeat the failed rounds and two switches); a higher one expects
    what its rounds made plus the rise (the lookup's part of it), and comes back where that pays."""
    from longspec.decoding import controller
    from longspec.decoding.controller import Controller

    tree, t1 = TreeSpec.parse("4,4,1"), (1.0, 0, 1.0)
    c = timed_plain(Controller(), 1.0)
    c.learned.pairs[("4,4,1", t1)], c.learned.calls[("4,4,1", t1)] = (2.0, 2.0), 3
    assert c.begin({tree: (2.0, 1.2), None: (1.0, 1.0)}, t1) == tree
    ran = [tree]
    for _ in range(controller.RETRY_AFTER + 12):
        ran.append(c.observe(*((1.0, 1.2e-3) if ran[-1] == tree else (1.0, 1e-3))))
    assert set(ran[-controller.RETRY_AFTER:]) == {None}
    c.repredict({tree: 2.0})  # (what it ran with)
    assert c.observe(1.0, 1e-3) is None and not c.candidates["4,4,1"].retried
    # a little higher: what its rounds made (1.0) and the rise (0.3 tokens) are slower than plain rounds
    c.repredict({tree: 2.3})
    assert c.observe(1.0, 1e-3) is None and not c.candidates["4,4,1"].retried
    c.repredict({tree: 4.0})
    assert c.observe(1.0, 1e-3) == tree and c.candidates["4,4,1"].retried
    assert c.candidates["4,4,1"].prior == pytest.approx(3.0)  # (1.0 made, 2.0 more predicted)
    c.repredict({tree: 4.0})  # (again before it runs: what it made still counts)
    assert c.candidates["4,4,1"].prior == pytest.approx(3.0)


def test_plain_rounds_timed_slow_do_not_keep_a_chain_that_costs_less_running():
    """A process's first plain rounds, the device still idling after its captures, measured 1.94
    ms (they take 1.19): the chain, 1.29 ms a round at 1.04 tokens, then looked 1.6x faster than
    plain rounds and ran every later call at 0.95x plain decoding, plain rounds never timed again.
    A plain round does less than any other (the same step, one token, no draft): it is taken to
    cost no more than the chain's, so the next call, the chain expected within RETIME_MARGIN of
    it, times plain rounds again, and they keep the call."""
    from longspec.decoding import controller
    from longspec.decoding.controller import Controller

    chain = TreeSpec.chain(5)
    predicted = {chain: (1.6, 1.77), None: (1.0, 1.52)}
    c = timed_plain(Controller(), 1.94)
    c.rounds = controller.RETIME_AFTER  # (plain rounds timed in the process's first call)

    def call(rounds):
        ran = [c.begin(predicted, "t1")]
        for _ in range(rounds):
            ran.append(c.observe(*((1.04, 1.29e-3) if ran[-1] == chain else (1.0, 1.19e-3))))
        c.end()
        return ran

    assert set(call(120)) == {chain}  # (1.6 tokens predicted: the chain runs first)
    assert c.candidates["plain"].ms == pytest.approx(1.29)
    ran = call(60)
    assert ran[0] is None and set(ran[-40:]) == {None} and c.round_ms("plain") == pytest.approx(1.19)


def test_on_a_gpu_trees_never_timed_run_a_few_rounds_once_where_they_could_be_the_fastest():
    """On a GPU the cost model's proposals are uncompiled: trees never timed, their time scaled by
    other kinds' rounds, were expected just below plain rounds and did not run for nine calls of a
    process where they paid 1.1-1.3x plain rounds. Where at UNTIMED_SHARE of its time a tree
    would be the fastest, one runs a few rounds once a process (from its second call, after the
    running candidate's first rounds), and its own time decides: it stays where it pays, leaves
    where it does not. Not where it could not be the fastest even so, not twice (a probe cut
    short by its call's end), and not on a CPU, whose cost model times the engine's own steps."""
    from longspec.decoding import controller
    from longspec.decoding.controller import Controller

    tree, chain = TreeSpec.parse("4,4,1"), TreeSpec.chain(5)

    def process(offset=False):
        c = timed_plain(Controller(offset=offset), 1.19)
        c.calls = 1  # (a warm-up call ran)
        return c

    def call(c, tree_ms, tokens=1.48, rounds=40):
        times, *_ = c.records("t1")
        times["chain:5"] = [1.29] * controller.SETTLED_ROUNDS
        # (the tree: 1.48 tokens in 1.83 ms scaled, 0.81 a ms; plain rounds 0.84, the chain 0.81)
        ran = [c.begin({tree: (tokens, 2.34), chain: (1.04, 1.77), None: (1.0, 1.52)}, "t1")]
        for _ in range(rounds):
            ms = {tree: tree_ms, chain: 1.29, None: 1.19}[ran[-1]]
            ran.append(c.observe({tree: 1.65, chain: 1.04, None: 1.0}[ran[-1]], ms / 1e3))
        c.end()
        return ran

    settled = controller.SETTLED_ROUNDS
    ran = call(process(), 1.5)
    assert ran[:settled] == [None] * settled and ran[settled] == tree and set(ran[-30:]) == {tree}, ran
    c = process()
    ran = call(c, 3.0)
    assert 0 < ran.count(tree) <= controller.DWELL and set(ran[-20:]) == {None}, ran
    assert tree not in call(c, 3.0)[1:]  # (timed now: 0.55 tokens a ms)
    c = process()
    assert call(c, 3.0, rounds=settled + 1)[-1] == tree  # (cut short: one round of the tree, at 3 ms)
    assert tree not in call(c, 3.0)  # (still untimed, as expected as before: not probed again)
    assert tree not in call(process(), 1.5, tokens=1.2)  # (0.66 a ms: 0.82 at 0.8 its time)
    assert tree not in call(timed_plain(Controller(), 1.19), 1.5)  # (a process's first call)
    assert set(call(process(offset=True), 1.5)) == {None}

def test_on_a_cpu_a_chain_never_timed_runs_a_few_rounds_once_where_it_could_be_the_fastest():
    """A CPU's cost model times a short prompt's chain at its first measured context (1,024
    tokens): on a 2-core CPU continuing ``def fibonacci(n):`` the chain, expected at 2.27 tokens
    in 120 ms against plain rounds' 58, never ran, where prompt lookup alone was 1.3x plain
    decoding (its rounds about 85 ms). Where at UNTIMED_SHARE of its time a chain would be the
    fastest, it runs a few rounds once a process, from the first call (every `longspec
    generate` is a new process), and stays where it pays; the trees, 3x plain rounds there, are
    not probed, nor chains on a GPU."""
    from longspec.decoding import controller
    from longspec.decoding.controller import Controller

    chain, tree = TreeSpec.chain(7), TreeSpec.parse("2,2,2")
    predicted = {chain: (2.2, 121.8), tree: (2.3, 144.8), None: (1.0, 60.6)}  # (estimates: chain 1.07x plain)

    def call(c, chain_ms, predicted=predicted):
        ran = [c.begin(predicted, "greedy")]
        for _ in range(30):
            tokens, ms = {chain: (2.2, chain_ms), tree: (2.3, 140.0), None: (1.0, 58.1)}[ran[-1]]
            ran.append(c.observe(tokens, ms / 1e3))
        c.end()
        return ran

    settled = controller.SETTLED_ROUNDS
    ran = call(timed_plain(Controller(offset=True), 58.1), 85.0)
    assert ran[:settled] == [None] * settled and ran[settled] == chain and set(ran[-20:]) == {chain}, ran
    c = timed_plain(Controller(offset=True), 58.1)
    ran = call(c, 150.0)  # (a chain that does not pay: back to plain rounds)
    assert 0 < ran.count(chain) <= controller.DWELL and set(ran[-15:]) == {None}, ran
    assert tree not in ran
    gpu = timed_plain(Controller(), 58.1)
    gpu.calls = 1
    assert set(call(gpu, 85.0, {chain: predicted[chain], None: predicted[None]})) == {None}
