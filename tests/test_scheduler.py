"""The scheduler: first come, first served while rows and KV blocks allow, no overtaking, no
preemption; every output equals its sequence's output alone. A seeded sequence's draws are its
own whoever joins beside it."""
import pytest
import torch

from longspec import GenerationConfig
from longspec.decoding.generator import Generator
from longspec.engine.engine import Engine, Sequence
from longspec.engine.scheduler import Scheduler
from longspec.spec.prompt_lookup import PromptLookup
from longspec.spec.sampling import RowSampling
from longspec.spec.tree import TreeSpec
from test_speculative import prompts_for


def run(scheduler: Scheduler, engine: Engine) -> list:
    """The canonical loop; returns the sequences admitted at each step."""
    waves = []
    while scheduler.has_work:
        admitted = scheduler.schedule()
        waves.append(admitted)
        engine.add(admitted)
        engine.step()
    return waves


@pytest.mark.parametrize("proposer", ["none", "pld"])
def test_sequences_join_in_order_as_blocks_free_up(targets, proposer):
    """A pool of 3 blocks of 64 under 4 rows: the 2-block sequence waits while a 1-block one runs
    and holds back the 1-block sequences behind it (no overtaking); each joins as soon as the
    blocks it needs are back, and every output equals the sequence's output alone."""
    target = targets["llama"]
    prompts = prompts_for(5, seed=41)
    budgets = [20, 4, 70, 6, 5]  # (sequence 2 needs two blocks with its tree, the others one)
    alone = [Generator(target).generate([p], GenerationConfig(max_new_tokens=n, ignore_eos=True)).sequences[0]
             for p, n in zip(prompts, budgets)]
    draft = None if proposer == "none" else PromptLookup()
    engine = Engine(target, draft, None if draft is None else TreeSpec.parse("chain:3"), max_batch=4, max_len=128,
                    pool_tokens=192, block_size=64)
    seqs = [Sequence(p, n) for p, n in zip(prompts, budgets)]
    assert [engine.blocks.blocks_for(s) for s in seqs] == [1, 1, 2, 1, 1]
    scheduler = Scheduler(engine)
    scheduler.submit(seqs)
    waves = [[seqs.index(s) for s in wave] for wave in run(scheduler, engine) if wave]
    # 0 and 1 fill two blocks; 2 waits for 1 to finish, then for 0 (3 and 4 wait behind it)
    assert waves[0] == [0, 1] and waves[1] == [2] and sum(waves, []) == [0, 1, 2, 3, 4], waves
    assert [s.tokens for s in seqs] == alone
    assert engine.pool.num_free == engine.pool.num_blocks and not engine.has_active


def test_a_sequence_that_never_fits_is_refused_when_submitted(targets):
    target = targets["llama"]
    engine = Engine(target, None, None, max_batch=2, max_len=256, pool_tokens=128, block_size=64)
    scheduler = Scheduler(engine)
    fits, too_long = Sequence([1] * 50, 10), Sequence([1] * 150, 10)
    with pytest.raises(ValueError, match="3 KV blocks of 64 tokens, more than the pool's 2"):
        scheduler.submit([fits, too_long])
    with pytest.raises(ValueError, match="prompt must hold at least one token"):
        scheduler.submit([Sequence([], 4)])
    assert not scheduler.waiting  # (none of a refused batch is queued)
    scheduler.submit([fits, Sequence([2] * 60, 10)])
    assert scheduler.drop(scheduler.waiting[1]) and not scheduler.drop(Sequence([1], 2))
    assert scheduler.schedule() == [fits] and not scheduler.waiting


@pytest.mark.parametrize("proposer", ["none", "pld"])
def test_a_seeded_sequence_draws_its_own_numbers_whoever_joins_beside_it(targets, proposer):
    """A sampled sequence with a seed gets the same tokens alone as with sampled sequences joining
    in later rows while it runs: their first tokens are drawn from the shared generator, not
    from the running row's own (which a prefill at row 1 used to take its numbers from)."""
    target = targets["llama"]
    prompts = prompts_for(3, seed=43)

    def seeded_tokens(others: bool) -> list:
        draft = None if proposer == "none" else PromptLookup()
        engine = Engine(target, draft, None if draft is None else TreeSpec.parse("chain:3"), max_batch=3,
                        max_len=96, config=RowSampling.zeros(3, "cpu"))
        engine.uniforms.generator = torch.Generator().manual_seed(0)
        seeded = Sequence(prompts[0], 16, temperature=1.0, seed=5)
        engine.add([seeded])
        engine.step()
        for p in prompts[1:] if others else ():
            engine.add([Sequence(p, 16, temperature=1.0)])
            engine.step()
        while engine.has_active:
            engine.step()
        assert not engine.uniforms.row_generators  # (the row's generator left with it)
        return seeded.tokens

    assert seeded_tokens(others=True) == seeded_tokens(others=False)


def test_the_schedule_takes_what_can_admit_allows_with_cached_prefixes(targets):
    """With a prefix cache (idle cached blocks evictable unless a prompt pins them), the one-pass
    schedule admits exactly the longest run of waiting sequences that ``Engine.can_admit``
    accepts together, for waves of prompts sharing cached prefixes or not."""
    target = targets["llama"]
    gen = torch.Generator().manual_seed(7)
    shared = torch.randint(0, 160, (128,), generator=gen).tolist()
    for trial in range(6):
        engine = Engine(target, None, None, max_batch=6, max_len=384, pool_tokens=640, prefix_cache=True)
        warm = Sequence(shared + [1, 2], 3)  # leaves the shared prefix's blocks cached, idle
        engine.add([warm])
        while engine.has_active:
            engine.step()
        seqs = []
        for _ in range(6):
            rest = torch.randint(0, 160, (int(torch.randint(1, 90, (1,), generator=gen)),), generator=gen).tolist()
            prompt = (shared if torch.rand(1, generator=gen) < 0.5 else []) + rest
            seqs.append(Sequence(prompt, int(torch.randint(2, 120, (1,), generator=gen))))
        scheduler = Scheduler(engine)
        scheduler.submit(seqs)
        longest = max(k for k in range(len(seqs) + 1) if engine.blocks.can_admit(seqs[:k]))
        assert scheduler.schedule() == seqs[:longest], trial
