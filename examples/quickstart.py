"""Continue a source file with `auto` (the default model, its shipped draft) and with plain
decoding (the README's Python example). Runs as it is on a fresh machine after the README's
install command (CPU or GPU):

    python examples/quickstart.py
"""
print("loading torch, transformers and longspec ...", flush=True)  # (a few seconds)
import torch
from transformers import AutoTokenizer

import longspec.spec.prompt_lookup as source_file
from longspec import GenerationConfig, Generator, default_model_path, load_target

# float32: speculative output equals plain output token for token (bfloat16 may differ at near-ties)
target = load_target(default_model_path(), dtype=torch.float32, device="cuda" if torch.cuda.is_available() else "cpu")
tokenizer = AutoTokenizer.from_pretrained(default_model_path())
prompt = tokenizer(open(source_file.__file__).read()).input_ids  # (code: its continuation repeats it)
config = GenerationConfig(max_new_tokens=64)
show = lambda row, tokens: print(tokenizer.decode(tokens), end="", flush=True)  # noqa: E731 (the text as it comes)

print(f"auto on a {len(prompt)}-token source file (its prefill takes seconds on a CPU):", flush=True)
fast = Generator(target, proposer="auto").generate([prompt], config, streamer=show)
print("\nplain decoding, the same prompt:", flush=True)
plain = Generator(target).generate([prompt], config, streamer=show)
print(f"\n{fast.stats['tokens_per_s']:.1f} tokens/s against plain decoding's {plain.stats['tokens_per_s']:.1f}, "
      f"tau {fast.stats['tau']:.2f}; same tokens as plain decoding: {fast.sequences == plain.sequences}")
assert fast.sequences == plain.sequences
