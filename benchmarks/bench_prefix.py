"""Prefix-cache benchmark: multi-turn traces through `longspec serve`'s HTTP API, with the prefix
cache and without (``--no-prefix-cache``), one request at a time (streamed, greedy).

Traces:

* **document**: a long document (``--context`` tokens) and ``--questions`` questions about it,
  each request = document + question;
* **chat**: a conversation growing turn by turn, each turn's prompt = the previous prompt + the
  answer it got + a new user message (``--turns`` turns, starting from the document's second
  half).

Per request: prompt tokens, tokens read from the cache (``usage.prompt_tokens_details``), time to
first token (TTFT) with and without the cache, and decode milliseconds per token. For each
request that hit the cache, the goal's yardstick: a cold request made of only the tokens after
the shared prefix (the question, or the new turn), on the server without the cache; the goal is
``TTFT(cached) <= 1.1 x TTFT(cold, prompt - shared prefix)``. On CUDA, beside it, the floor of
that ratio: the cold tail's TTFT plus one read of the cached K/V at the measured copy bandwidth
(the cached request's queries must read them; at the 8B shape 32k cached tokens are 4.3 GB, 1.0
ms on an H200). Beside each TTFT, the server's own
``timings_ms["prefill"]`` (from the start of the request's prefill to its first token, without the
client's and the server's handling of the prompt's JSON), its parse and queue time, its ``send``
(the first text's way from the engine's thread out of the event loop) and what is left outside
the server's timings (the client, the HTTP layers). On CUDA prompts are prefilled in
captured chunks (``--prefill-chunk``, default 1024), a prompt's rest, as the tokens after a cached
prefix, in the smaller chunks of its ladder (``--prefill-sizes``; ``--prefill-sizes 1024``: the
big chunk alone, for comparison). Per trace and server: throughput
(generated tokens / wall time of the trace) and the hit rate. Before the traces, each server gets
two requests in neither trace: a short one, and one as long as the document sharing nothing with it
(its TTFT printed): both servers run in one process on one target, so without it only the first
server would pay the process's first long prompt's one-off costs. (The hit rate counts them.) A
table, then one JSON line last.

Requests go as token ids (``--api completions``, the default) or, with a real tokenizer, as chat
messages (``--api chat``): the server then renders and tokenises the whole conversation on every
request, as it does for a chat client (its tokenizer cache keeps the earlier messages' ids, see
``longspec/serving/tokenizing.py``); the document trace sends the document as a system message and the
question as the user's. Either way a request's JSON body is encoded before its clock starts.

The server runs in this process (FastAPI app on uvicorn in a thread, the same code as
``longspec serve``), so a random-weight target needs no files:

    python benchmarks/bench_prefix.py                      # the default model on the CPU
    python benchmarks/bench_prefix.py --target DIR --device cuda --context 16384
    python benchmarks/bench_prefix.py --shape llama-8b --context 32768 --device cuda --dtype bfloat16
"""
from __future__ import annotations

import argparse
import json
import platform
import socket
import statistics
import threading
import time
from pathlib import Path

import torch

from bench_steps import SHAPES, copy_bandwidth, cuda_defaults, random_target

from longspec.kv.cache import token_bytes
from longspec.kv.prefix_cache import common_prefix


def cached_kv_bytes(config, tokens: int, dtype: torch.dtype) -> int:
    """Bytes of K/V that a request's queries read from ``tokens`` cached ones: every layer's (a
    sliding-window layer's window only)."""
    per_layer = token_bytes(config, dtype) // config.num_layers  # one token's K/V in one layer
    return sum(per_layer * (min(tokens, config.sliding_window) if config.is_sliding(i) else tokens)
               for i in range(config.num_layers))


class IdTokenizer:
    """What the server needs of a tokenizer for a random-weight target fed token ids: ids decode
    to their numbers (text only the client sees)."""

    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f" {i}" for i in ids)

    def get_vocab(self):
        return {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class InProcessServer:
    """``longspec serve``'s application over ``target`` on uvicorn in a thread."""

    def __init__(self, target, tokenizer, args, prefix_cache: bool):
        import uvicorn

        from longspec.spec.proposers import build_proposer, default_tree
        from longspec.serving.server import build_server
        from longspec.serving.http import create_app

        proposer = build_proposer(args.proposer, target, args.draft)
        tree = None if proposer is None else (args.tree or default_tree(args.proposer))
        cuda = target.device.type == "cuda"
        chunk = args.prefill_chunk if args.prefill_chunk is not None else min(1024, args.max_len) if cuda else 0
        if chunk and args.prefill_sizes:
            chunk = [int(s) for s in args.prefill_sizes.split(",")]
        self.server = build_server(target, tokenizer, "bench", proposer, tree, max_batch=1, max_len=args.max_len,
                                   prefill_chunk=chunk or None, prefix_cache=prefix_cache,
                                   threads=args.engine_threads)
        chunked = self.server.engine.chunked_prefill
        self.prefill = f"chunks of {'/'.join(map(str, chunked.sizes[::-1]))}" if chunked else "one eager prefill"
        if cuda:
            self.server.engine.warm_up()
        self.port = free_port()
        self.uvicorn = uvicorn.Server(uvicorn.Config(create_app(self.server), host="127.0.0.1", port=self.port,
                                                     log_level="warning"))
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        while not self.uvicorn.started:
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self):
        self.uvicorn.should_exit = True
        self.thread.join(timeout=30)
        self.server.engine.close()


_client = None


def stream(url: str, prompt, max_tokens: int) -> dict:
    """One streamed greedy completion of ``prompt`` (token ids: ``/v1/completions``; chat messages:
    ``/v1/chat/completions``) -> ttft_s, ms per decoded token, generated ids, usage. The body is
    encoded to JSON before the clock starts: the client's own encoding is not the server's time."""
    import httpx

    chat = isinstance(prompt[0], dict)
    body = json.dumps({"messages" if chat else "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True}).encode()
    start = time.perf_counter()
    first = last = None
    final = {}
    global _client
    if _client is None:  # one connection for the run, as an API client keeps (not a new one per request)
        _client = httpx.Client(timeout=3600)
    with _client.stream("POST", url + ("/v1/chat/completions" if chat else "/v1/completions"), content=body,
                        headers={"content-type": "application/json"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            payload = json.loads(line[6:])
            now = time.perf_counter()
            choice = payload["choices"][0]
            if (choice["delta"].get("content") if chat else choice["text"]) and first is None:
                first = now
            last = now
            if choice["finish_reason"] is not None:
                final = payload
    first = first or last
    ids = final["longspec"]["token_ids"]
    return {"ttft_s": first - start, "decode_ms": 1000 * (last - first) / max(len(ids) - 1, 1), "ids": ids,
            "server_ms": final["longspec"]["timings_ms"], "prompt_tokens": final["usage"]["prompt_tokens"],
            "cached_tokens": final["usage"]["prompt_tokens_details"]["cached_tokens"]}


def before_prefill(result: dict) -> float:
    """Milliseconds the server spent on a request before its prefill: parsing its body
    (tokenising a text) and waiting for the worker (matching its prompt against the cache)."""
    return result["server_ms"]["parse"] + result["server_ms"]["queue"]


def outside_server(result: dict) -> float:
    """Milliseconds of its time to first token that the server's timings do not cover: the
    client's send and receive, the HTTP layers before the body is read and after the first text
    leaves the event loop."""
    ms = result["server_ms"]
    return 1e3 * result["ttft_s"] - before_prefill(result) - ms["prefill"] - ms["send"]


def build_traces(args, vocab: int, tokenizer) -> dict:
    """{doc, questions, turns}: token ids, or with ``--api chat`` texts (and ``chat``: the
    tokenizer); the document trace's prompts are fixed, the chat's are built while it runs (they
    contain the answers)."""
    if tokenizer is not None and not isinstance(tokenizer, IdTokenizer):
        root = Path(__file__).resolve().parent.parent
        text = "\n\n".join(p.read_text() for p in sorted((root / "docs").glob("*.md")) + [root / "README.md"])
        doc = tokenizer(text, add_special_tokens=False).input_ids
        while len(doc) < args.context:
            doc = doc + doc
        doc = doc[:args.context]

        def say(k: int, what: str) -> list:
            return tokenizer(f"\n\nQuestion {k}: {what}\nAnswer:", add_special_tokens=False).input_ids
    else:
        gen = torch.Generator().manual_seed(0)
        doc = torch.randint(0, vocab, (args.context,), generator=gen).tolist()

        def say(k: int, what: str) -> list:
            return torch.randint(0, vocab, (24 + len(what) % 16,), generator=torch.Generator().manual_seed(k)).tolist()

    asks = ["what is this document about, in one sentence?", "which command starts the server, and with what "
            "options?", "what does the method change about the draft model's memory?", "list three limits stated.",
            "what would you test first?", "summarise the previous answer."]
    questions = [say(k, asks[k % len(asks)]) for k in range(args.questions)]
    turns = [say(100 + k, asks[(k + 3) % len(asks)]) for k in range(args.turns)]
    if args.api == "chat":  # the same texts, as a chat client sends them
        return {"doc": tokenizer.decode(doc), "questions": [tokenizer.decode(q).strip() for q in questions],
                "turns": [tokenizer.decode(t).strip() for t in turns], "chat": tokenizer}
    return {"doc": doc, "questions": questions, "turns": turns}


def run_trace(url: str, trace: dict, kind: str, max_tokens: int, replay: list = None) -> list:
    """Requests of trace ``kind`` one after another -> per request: prompt (token ids), shared
    prefix, result. ``replay``: the chat prompts of an earlier run (so both servers see the same
    prompts). With ``trace["chat"]`` (a tokenizer: ``--api chat``) each request goes as chat
    messages: the document trace as the document in a system message and a question, the chat
    as the conversation so far; a request's shared prefix is the tokens it starts with of the
    request before it (the server tokenises the messages; this client does the same to know
    which tokens the cache could hold)."""
    doc, out, chat = trace["doc"], [], trace.get("chat")
    if chat is not None:
        def ids(messages):
            return chat(chat.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False).input_ids

        def shared(prompt):
            before = out[-1]["prompt"] if out else []
            return common_prefix(prompt, before)

    if kind == "document":
        for q in trace["questions"]:
            if chat is None:
                out.append({"prompt": doc + q, "shared": len(doc), **stream(url, doc + q, max_tokens)})
            else:
                messages = [{"role": "system", "content": doc}, {"role": "user", "content": q}]
                prompt = ids(messages)
                out.append({"prompt": prompt, "shared": shared(prompt), **stream(url, messages, max_tokens)})
        return out
    if chat is not None:
        # (not the document's start: its blocks are cached)
        messages = [{"role": "user", "content": doc[len(doc) // 2:]}]
        for k, turn in enumerate(trace["turns"]):
            if replay is not None:
                messages = replay[k]["messages"]
            else:
                messages = messages[:-1] + [{"role": "user", "content": messages[-1]["content"] + "\n\n" + turn}] \
                    if k == 0 else messages + [{"role": "assistant", "content": chat.decode(
                        out[-1]["ids"], skip_special_tokens=True)}, {"role": "user", "content": turn}]
            prompt = ids(messages)
            out.append({"prompt": prompt, "shared": shared(prompt) if k else 0, "messages": messages,
                        **stream(url, messages, max_tokens)})
        return out
    prompt, shared_ids = doc[len(doc) // 2:], 0  # (not the document's start: its blocks are cached)
    for k, turn in enumerate(trace["turns"]):
        if replay is not None:
            prompt, shared_ids = replay[k]["prompt"], replay[k]["shared"]
        else:
            prompt, shared_ids = (prompt + turn if k == 0 else prompt + out[-1]["ids"] + turn), len(prompt) + (
                len(out[-1]["ids"]) if k else 0)
        out.append({"prompt": prompt, "shared": shared_ids if k else 0, **stream(url, prompt, max_tokens)})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="HF-format model directory (default: the default model)")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="a random-weight target of this shape instead of --target (no files; token-id prompts)")
    p.add_argument("--context", type=int, default=3000, help="document tokens (default: 3000)")
    p.add_argument("--questions", type=int, default=3, help="questions about the document (default: 3)")
    p.add_argument("--turns", type=int, default=3, help="chat turns (default: 3)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (default: 32)")
    p.add_argument("--api", default="completions", choices=["completions", "chat"],
                   help="requests as token ids (completions) or as chat messages whose text the server tokenises "
                        "(chat; needs a model with a chat template)")
    p.add_argument("--proposer", default="none", choices=["none", "pld", "streaming", "longspec", "hybrid"])
    p.add_argument("--tree", default=None)
    p.add_argument("--draft", default=None, help="LongSpec draft directory (longspec, hybrid)")
    p.add_argument("--max-len", type=int, default=None,
                   help="tokens per request (default: what the longest chat turn needs, in 1024s)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="as longspec serve's (default: 1024 on CUDA, 0 = one eager prefill on a CPU)")
    p.add_argument("--prefill-sizes", default=None,
                   help="the prefill chunks' ladder, comma separated (default: --prefill-chunk's, e.g. 1024,128,32; "
                        "1024 alone pads a prompt's rest to a whole 1024-token chunk)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for PyTorch")
    p.add_argument("--out", default=None, help="also write the report to this file")
    p.add_argument("--note", default="", help="a line for the report's header (e.g. that the CPU is shared)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    args.engine_threads = None
    if args.device == "cpu":  # as longspec serve: the engine's thread alone runs parallel CPU work
        args.engine_threads = torch.get_num_threads()
        torch.set_num_threads(1)
    if args.shape:
        target = cuda_defaults(random_target(args.shape, dtype, args.device))  # as load_target sets it up
        tokenizer, model = IdTokenizer(), f"random {args.shape}"
    else:
        from transformers import AutoTokenizer

        from longspec import load_target
        from longspec.convert import default_model_dir

        path = Path(args.target) if args.target else default_model_dir()
        target, tokenizer, model = load_target(path, dtype=dtype, device=args.device), \
            AutoTokenizer.from_pretrained(path), path.name
    if args.api == "chat" and not getattr(tokenizer, "chat_template", None):
        p.error("--api chat needs a tokenizer with a chat template (not --shape)")
    trace = build_traces(args, target.config.vocab_size, tokenizer)
    size = len if args.api == "completions" else (  # tokens of a request's part (chat: + its template's)
        lambda text: len(tokenizer(text, add_special_tokens=False).input_ids) + 16)
    longest = size(trace["doc"]) // 2 + sum(map(size, trace["turns"])) + args.turns * (args.max_tokens + 16)
    longest = max(longest, size(trace["doc"]) + max(map(size, trace["questions"]), default=0) + 32)
    args.max_len = args.max_len or -(-(longest + args.max_tokens + 128) // 1024) * 1024
    lines = []

    def say(line=""):
        print(line, flush=True)
        lines.append(line)

    threads = args.engine_threads or torch.get_num_threads()
    say(f"# bench_prefix: {model} on {args.device} ({args.dtype}, {threads} threads), "
        f"{platform.node()}, torch {torch.__version__}")
    say(f"# document {args.context} tokens + {args.questions} questions; chat of {args.turns} turns from "
        f"{args.context // 2} tokens; {args.max_tokens} tokens per answer; proposer {args.proposer}; max_len "
        f"{args.max_len}")
    if args.note:
        say(f"# {args.note}")
    results, health = {}, {}
    gen = torch.Generator().manual_seed(1)
    warm = torch.randint(0, target.config.vocab_size, (64,), generator=gen).tolist()
    # as long as the document, sharing nothing with the traces: the first long prompt's one-off costs
    # (in one process: the servers share the target, so only the first server would pay them)
    long_warm = torch.randint(0, target.config.vocab_size, (args.context,), generator=gen).tolist()
    for cached in (True, False):
        server = InProcessServer(target, tokenizer, args, prefix_cache=cached)
        try:
            stream(server.url, warm, 4)  # the first request's one-off costs, in neither trace
            first_long = stream(server.url, long_warm, 4)
            say(f"# {'with' if cached else 'without'} the cache, the server's first long request ({len(long_warm)} "
                f"tokens, in neither trace): TTFT {first_long['ttft_s']:.3f} s, its prefill "
                f"{first_long['server_ms']['prefill']:.1f} ms on the server")
            if cached:
                say(f"# prefill: {server.prefill}")
            runs = {"document": run_trace(server.url, trace, "document", args.max_tokens)}
            runs["chat"] = run_trace(server.url, trace, "chat", args.max_tokens,
                                     None if cached else results["cache"]["chat"])
            if not cached:  # the goal's yardstick: the uncached part of each cached request, cold
                for kind, reqs in runs.items():
                    for r, c in zip(reqs, results["cache"][kind]):
                        if c["cached_tokens"] and c["shared"]:  # (not a chat's first turn: a template's first tokens)
                            r["tail"] = stream(server.url, c["prompt"][c["shared"]:], args.max_tokens)
            import httpx

            state = httpx.get(server.url + "/health").json()
            health["cache" if cached else "no_cache"] = state["kv_cache"]
            if cached:
                health["tokenizer"] = state["tokenizer_cache"]
        finally:
            server.close()
        results["cache" if cached else "no_cache"] = runs

    summary = {"model": model, "device": args.device, "context": args.context, "proposer": args.proposer}
    # the goal's floor: a cached request's queries read the cached K/V at least once, which its cold
    # tail does not (at the device's copy bandwidth; on a CPU not measured)
    bandwidth = copy_bandwidth() if target.device.type == "cuda" else None
    if bandwidth:
        say(f"\n# copy bandwidth {bandwidth / 1e12:.2f} TB/s: reading the cached K/V once takes at least "
            f"{1e3 * cached_kv_bytes(target.config, args.context, dtype) / bandwidth:.2f} ms for "
            f"{args.context} cached tokens")
    for kind in ("document", "chat"):
        say(f"\n## {kind} trace")
        say(f"{'req':>3} {'prompt':>7} {'shared':>7} {'cached':>7} {'ttft cache s':>12} {'ttft cold s':>11} "
            f"{'tail':>5} {'ttft tail s':>11} {'cache/tail':>10} {'cache/cold':>10} {'ms/tok cache':>12} "
            f"{'ms/tok cold':>11} {'prefill ms cache':>16} {'cold':>7} {'tail':>6} {'parse+queue ms cache':>20} {'tail':>6} "
            f"{'send ms cache':>13} {'tail':>5} {'outside ms cache':>16} {'tail':>5} same")
        ratios, full_ratios, prefill_ratios, floors = [], [], [], []
        for i, (c, n) in enumerate(zip(results["cache"][kind], results["no_cache"][kind])):
            tail = n.get("tail")
            ratio = c["ttft_s"] / tail["ttft_s"] if tail else float("nan")
            if tail:
                ratios.append(ratio)
                full_ratios.append(c["ttft_s"] / n["ttft_s"])
                prefill_ratios.append(c["server_ms"]["prefill"] / tail["server_ms"]["prefill"])
                if bandwidth:  # the best cached / tail ratio: the tail's TTFT plus one read of the cached K/V
                    read_s = cached_kv_bytes(target.config, c["cached_tokens"], dtype) / bandwidth
                    floors.append((tail["ttft_s"] + read_s) / tail["ttft_s"])
            say(f"{i:>3} {c['prompt_tokens']:>7} {c['shared']:>7} {c['cached_tokens']:>7} {c['ttft_s']:>12.3f} "
                f"{n['ttft_s']:>11.3f} {len(c['prompt']) - c['shared'] if tail else 0:>5} "
                f"{tail['ttft_s'] if tail else float('nan'):>11.3f} {ratio:>10.2f} {c['ttft_s'] / n['ttft_s']:>10.3f} "
                f"{c['decode_ms']:>12.1f} {n['decode_ms']:>11.1f} {c['server_ms']['prefill']:>16.1f} "
                f"{n['server_ms']['prefill']:>7.1f} {tail['server_ms']['prefill'] if tail else float('nan'):>6.1f} "
                f"{before_prefill(c):>20.1f} {before_prefill(tail) if tail else float('nan'):>6.1f} "
                f"{c['server_ms']['send']:>13.2f} {tail['server_ms']['send'] if tail else float('nan'):>5.2f} "
                f"{outside_server(c):>16.2f} {outside_server(tail) if tail else float('nan'):>5.2f} "
                f"{c['ids'] == n['ids']}")
        gen_tokens = {k: sum(len(r["ids"]) for r in results[k][kind]) for k in ("cache", "no_cache")}
        wall = {k: sum(r["ttft_s"] + r["decode_ms"] * (len(r["ids"]) - 1) / 1000 for r in results[k][kind])
                for k in ("cache", "no_cache")}
        tput = {k: gen_tokens[k] / wall[k] for k in wall}
        say(f"throughput (generated tokens / s over the trace): cache {tput['cache']:.2f}, no cache "
            f"{tput['no_cache']:.2f} ({tput['cache'] / tput['no_cache']:.2f}x); trace wall {wall['cache']:.1f} s vs "
            f"{wall['no_cache']:.1f} s")
        if ratios:
            say(f"TTFT cached / cold tail: median {statistics.median(ratios):.2f}, worst {max(ratios):.2f} "
                f"(goal <= 1.10); cached / cold whole prompt: median {statistics.median(full_ratios):.3f}")
            say(f"the server's prefill (to the first token; timings_ms) cached / cold tail: median "
                f"{statistics.median(prefill_ratios):.2f}, worst {max(prefill_ratios):.2f}")
            if floors:
                say(f"the memory floor of TTFT cached / cold tail (the cold tail's TTFT + one read of the cached "
                    f"K/V): median {statistics.median(floors):.2f}")
        summary[kind] = {"throughput_cache": round(tput["cache"], 3), "throughput_no_cache": round(tput["no_cache"], 3),
                         "speedup": round(tput["cache"] / tput["no_cache"], 3),
                         "ttft_cache_over_tail_median": round(statistics.median(ratios), 3) if ratios else None,
                         "ttft_cache_over_tail_worst": round(max(ratios), 3) if ratios else None,
                         "ttft_cache_over_cold_median": round(statistics.median(full_ratios), 4) if ratios else None,
                         "server_prefill_cache_over_tail_median":
                             round(statistics.median(prefill_ratios), 3) if ratios else None,
                         "ttft_floor_over_tail_median": round(statistics.median(floors), 3) if floors else None,
                         "outputs_equal": all(c["ids"] == n["ids"] for c, n in
                                              zip(results["cache"][kind], results["no_cache"][kind]))}
    say(f"\nKV pool with the cache (/health): {json.dumps(health['cache'])}")
    say(f"tokenizer cache (/health): {json.dumps(health['tokenizer'])}")
    summary["hit_rate"] = health["cache"]["hit_rate"]
    say(json.dumps(summary))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
