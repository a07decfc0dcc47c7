"""Calls a running `longspec serve` through the openai client (docs/serving.md):

    longspec serve --proposer hybrid --port 8000        # in another terminal
    python examples/openai_client.py                    # or: python examples/openai_client.py URL
"""
import sys

from openai import OpenAI

base_url = sys.argv[1] if len(sys.argv) > 1 else "http://localhost:8000/v1"
client = OpenAI(base_url=base_url, api_key="none")
model = client.models.list().data[0].id

out = client.completions.create(model=model, prompt="def quicksort(xs):", max_tokens=32, temperature=0)
print(out.choices[0].text)
print("tau:", out.model_extra["longspec"]["tau"])  # longspec's extension: tokens per target forward

stream = client.chat.completions.create(model=model, max_tokens=32, stream=True,
                                        messages=[{"role": "user", "content": "Write a haiku about caches"}])
for chunk in stream:
    if chunk.choices:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
