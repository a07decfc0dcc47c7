"""Reduced draft vocabulary on a CPU: tau and tokens/s of the shipped draft scoring the whole
vocabulary or only the K most frequent tokens of (part of) its training data (numpy and networkx
sources), on held-out prompts (standard-library sources, never trained on), with plain decoding
and transformers' ``generate`` (decode time: 48 tokens minus 1) for comparison. Prints one dict
per setting.

    python benchmarks/bench_draft_vocab.py [--sizes 0,16384,8192,4096] [--threads 2]
"""
import argparse
import json
import pathlib
import sysconfig

import torch

from longspec import (GenerationConfig, LongSpecProposer, default_draft_path, default_model_path,
                      load_draft, load_target)
from longspec.decoding.generator import Generator
from longspec.training import frequent_tokens


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="0,16384,8192,4096", help="draft vocabulary sizes (0: the whole vocabulary)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=48)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    stdlib = pathlib.Path(json.__file__).parent.parent
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    target = load_target(default_model_path())
    ranked = frequent_tokens([site / "numpy", site / "networkx"], tokenizer, target.config.vocab_size,
                             target.config.vocab_size)
    prompts = [tokenizer((stdlib / name).read_text()).input_ids[:1024]
               for name in ("json/decoder.py", "argparse.py", "textwrap.py")]
    config = GenerationConfig(max_new_tokens=args.new_tokens, ignore_eos=True)
    decoded = len(prompts) * (args.new_tokens - 1)
    for k in map(int, args.sizes.split(",")):
        draft = load_draft(default_draft_path(), target)
        if k:
            draft.limit_vocab(ranked[:k])
        else:  # the whole vocabulary, through the ordinary LM head
            draft.config.draft_vocab = 0
        for tree in ("4,16,16,16,16", "chain:3"):
            gen = Generator(target, proposer=LongSpecProposer(draft), tree=tree)
            gen.generate([prompts[0][:64]], GenerationConfig(max_new_tokens=4, ignore_eos=True))  # warm-up
            outs = [gen.generate([prompt], config) for prompt in prompts]
            print({"vocab": k or target.config.vocab_size, "tree": tree,
                   "tau": round(sum(o.stats["tau"] for o in outs) / len(outs), 3),
                   "tokens_per_s": round(decoded / sum(o.stats["decode_s"] for o in outs), 2)}, flush=True)
    plain = Generator(target)
    plain.generate([prompts[0][:64]], GenerationConfig(max_new_tokens=4))
    print({"vocab": "plain decoding", "tokens_per_s": round(
        decoded / sum(plain.generate([prompt], config).stats["decode_s"] for prompt in prompts), 2)})
    import time

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()

    def hf_time(ids, n):
        start = time.perf_counter()
        hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=n,
                    min_new_tokens=n, do_sample=False)
        return time.perf_counter() - start

    hf_time(prompts[0][:64], 4)
    decode = sum(hf_time(p, args.new_tokens) - hf_time(p, 1) for p in prompts)
    print({"vocab": "transformers generate", "tokens_per_s": round(decoded / decode, 2)})


if __name__ == "__main__":
    main()
