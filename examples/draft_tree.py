"""Two prompts with the LongSpec draft as a proposer object and the paper's beam tree, against
plain decoding (the Python example of docs/usage.md). Runs as it is on a fresh machine after the
README's install command (CPU or GPU):

    python examples/draft_tree.py
"""
import torch
from transformers import AutoTokenizer

from longspec import (GenerationConfig, Generator, LongSpecProposer, default_draft_path, default_model_path,
                      load_draft, load_target)

device = "cuda" if torch.cuda.is_available() else "cpu"
# float32: speculative output equals plain output token for token. In bfloat16 a 69-token tree
# forward and a 1-token forward round differently, so at near-ties the two may differ.
target = load_target(default_model_path(), dtype=torch.float32, device=device)
tokenizer = AutoTokenizer.from_pretrained(default_model_path())
prompts = [tokenizer(text).input_ids for text in ("def fibonacci(n):\n", "import numpy as np\n\ndef normalize(x):\n")]
config = GenerationConfig(max_new_tokens=32)

plain = Generator(target).generate(prompts, config)
draft = load_draft(default_draft_path(), target)
spec = Generator(target, proposer=LongSpecProposer(draft), tree=[4, 16, 16, 16, 16]).generate(prompts, config)

for ids in spec.sequences:
    print(repr(tokenizer.decode(ids)))
print(f"tau {spec.stats['tau']:.2f} (tokens per target forward); same tokens as plain decoding: "
      f"{spec.sequences == plain.sequences}")
assert spec.sequences == plain.sequences
