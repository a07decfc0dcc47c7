"""Where does a decoding step's time go? Times (CUDA events, medians) the target's decode step,
a 69-node tree verify, a target forward over a small (StreamingLLM-sized) cache and one LongSpec
drafting round, on a random SmolLM2-shaped model (no checkpoint needed), then prints the
torch.profiler table of one decode step.

    python benchmarks/profile_steps.py [--context 4096] [--dtype bfloat16]
"""
import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from longspec import GenerationConfig, LongSpecProposer, TreeSpec, load_target  # noqa: E402
from longspec.models.draft import DraftConfig, init_draft  # noqa: E402


def timed(fn, repeats=20):
    times = []
    for i in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=16384,
                                   tie_word_embeddings=True, rope_theta=100000.0)
    path = Path(tempfile.mkdtemp())
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    target = load_target(path, dtype=args.dtype, device="cuda")
    n = args.context
    cache = target.new_cache(1, n + 512)
    ids = torch.randint(0, 49152, (1, n), device="cuda")
    target.prefill(ids, torch.tensor([n], device="cuda"), cache)
    tok = torch.tensor([7], device="cuda")

    def decode():
        target.decode(tok, cache)
        cache.lengths -= 1

    tree = TreeSpec.parse("4,16,16,16,16")
    tokens = torch.randint(0, 49152, (1, tree.num_nodes), device="cuda")
    mask = torch.ones(1, tree.num_nodes, tree.num_nodes, dtype=torch.bool, device="cuda").tril()
    positions = cache.lengths[:, None] + tree.depths.to("cuda")[None]

    def verify():
        target.verify(tokens, positions, mask, cache)
        cache.discard()

    small = target.new_cache(1, 600)
    target.prefill(ids[:, :580], torch.tensor([580], device="cuda"), small)

    def small_forward():
        target.verify(tokens[:, :16], small.lengths[:, None] + 1 + torch.zeros(1, 16, dtype=torch.long, device="cuda"),
                      torch.eye(16, dtype=torch.bool, device="cuda")[None], small)
        small.discard()

    draft = init_draft(DraftConfig.for_target(target), target)
    proposer = LongSpecProposer(draft)
    proposer.begin(target, cache, [ids[0].tolist()], tree, GenerationConfig(), None)

    def draft_round():
        proposer.propose(tok)

    with torch.inference_mode():
        rows = {"decode step": timed(decode), "verify 69-node tree": timed(verify),
                "forward 16 tokens over 580-slot cache": timed(small_forward),
                "LongSpec drafting round (beam 4,16x4)": timed(draft_round, 10)}
        for name, ms in rows.items():
            print(f"{name:<42} {ms:8.2f} ms")
        import cProfile
        import pstats

        from longspec import Generator

        gen = Generator(target, proposer=LongSpecProposer(draft), tree=tree)
        prompt = ids[0, :2000].tolist()
        gen.generate([prompt], GenerationConfig(max_new_tokens=16, ignore_eos=True))
        profiler = cProfile.Profile()
        profiler.enable()
        out = gen.generate([prompt], GenerationConfig(max_new_tokens=64, ignore_eos=True))
        profiler.disable()
        print("generate with LongSpecProposer:", {k: round(v, 3) if isinstance(v, float) else v
                                                   for k, v in out.stats.items()})
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
        from torch.profiler import ProfilerActivity, profile

        for name, fn in (("decode", decode), ("draft round", draft_round)):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            print(f"--- {name}")
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=50))


if __name__ == "__main__":
    main()
