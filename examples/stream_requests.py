"""Several requests through one engine, as the server runs them: a request joins between rounds
in a free row and leaves when it is done, without reallocating anything (docs/usage.md).

    python examples/stream_requests.py
"""
import torch
from transformers import AutoTokenizer

from longspec import (GenerationConfig, Generator, LongSpecProposer, PromptLookup, TreeSpec, default_draft_path,
                      default_model_path, load_draft, load_target)
from longspec.engine.engine import Engine, Sequence

device = "cuda" if torch.cuda.is_available() else "cpu"
target = load_target(default_model_path(), dtype=torch.float32, device=device)
tokenizer = AutoTokenizer.from_pretrained(default_model_path())
hybrid = LongSpecProposer(load_draft(default_draft_path(), target), lookup=PromptLookup())  # draft + prompt lookup
engine = Engine(target, hybrid, TreeSpec.parse("4,4,4,4,4"), max_batch=2, max_len=512)  # (sampling: per Sequence)

texts = ["def fibonacci(n):\n", "class Stack:\n", "import json\n\ndef load(path):\n"]
requests = [Sequence(tokenizer(text).input_ids, max_new_tokens=24) for text in texts]
waiting = list(requests)
while waiting or engine.has_active:
    while waiting and engine.free_rows():  # the third request joins when a row frees up
        engine.add([waiting.pop(0)])
    engine.step()  # one round (draft, verify, accept) for every active request

plain = Generator(target).generate([r.prompt for r in requests], GenerationConfig(max_new_tokens=24))
for request, alone in zip(requests, plain.sequences):
    print(f"tau {request.tau:.2f}  same tokens as plain decoding: {request.tokens == alone}  "
          f"{tokenizer.decode(request.tokens)!r}")
    assert request.tokens == alone
