"""Tensor parallelism from Python: the default model split over three CPU processes (its 9
attention heads, 3 KV heads and MLP divide by 3), which give the tokens of one process. On a host
with several GPUs, ``device="cuda"`` puts one process on each (NCCL) and ``dtype="bfloat16"``.

    python examples/tensor_parallel.py
"""
from transformers import AutoTokenizer

from longspec import GenerationConfig, Generator, ParallelGenerator, default_model_path, load_target

if __name__ == "__main__":  # (the other processes import this file)
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    prompt_ids = [tokenizer("def fibonacci(n):\n").input_ids]
    config = GenerationConfig(max_new_tokens=16)

    with ParallelGenerator(default_model_path(), tensor_parallel=3, proposer="pld", device="cpu",
                           dtype="float32") as gen:
        out = gen.generate(prompt_ids, config)

    alone = Generator(load_target(default_model_path()), proposer="pld").generate(prompt_ids, config)
    print(repr(tokenizer.decode(out.sequences[0])))
    print("same tokens as one process:", out.sequences == alone.sequences)
    assert out.sequences == alone.sequences
