"""Serving benchmark: `longspec serve` under concurrency 1 / 4 / 16 / 64, speculative vs plain
decoding. For each server configuration a server process is started, then for each concurrency
level that many streaming clients send requests back to back (prompts cut from real source code,
greedy, ``--max-tokens`` each); reported: throughput (generated tokens / s), time to first token
and inter-token latency (p50 / p99, from the arrival times of the streamed chunks). Prints a table
and one JSON line last.

    python benchmarks/bench_serve.py --target DIR [--draft DIR] --prompt-dir SRC \\
        --concurrency 1,4,16,64 --servers "none;hybrid;pld"
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def code_prompts(directory: Path, n: int, chars: int) -> list:
    texts = []
    for path in sorted(directory.rglob("*.py")):
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) >= chars:
            texts.append(text[:chars])
        if len(texts) >= n:
            break
    if not texts:
        raise SystemExit(f"no source file of {chars} characters under {directory}")
    return [texts[i % len(texts)] for i in range(n)]


def percentile(values: list, q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def one_request(client, url, prompt, max_tokens):
    start = time.perf_counter()
    arrivals, tokens = [], 0
    async with client.stream("POST", url + "/v1/completions", json={
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            payload = json.loads(line[5:])
            if payload["choices"][0]["text"]:
                arrivals.append(time.perf_counter())
            if payload["choices"][0]["finish_reason"] is not None:
                tokens = payload["usage"]["completion_tokens"]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    # the stream's own speed after its first chunk (time to first token left out)
    speed = (tokens - 1) / (arrivals[-1] - arrivals[0]) if tokens > 1 and len(arrivals) > 1 else float("nan")
    return (arrivals[0] - start if arrivals else float("nan")), gaps, tokens, speed


async def run_level(url, prompts, concurrency, max_tokens):
    queue = list(prompts)
    ttft, gaps, speeds, tokens = [], [], [], 0

    async def client_loop(client):
        nonlocal tokens
        while queue:
            prompt = queue.pop()
            first, g, n, speed = await one_request(client, url, prompt, max_tokens)
            ttft.append(first)
            gaps.extend(g)
            speeds.append(speed)
            tokens += n

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    wall = time.perf_counter() - start
    return {"concurrency": concurrency, "requests": len(prompts), "tokens": tokens, "tokens_per_s": tokens / wall,
            "ttft_p50_ms": 1e3 * percentile(ttft, 0.5), "ttft_p99_ms": 1e3 * percentile(ttft, 0.99),
            "itl_p50_ms": 1e3 * percentile(gaps, 0.5), "itl_p99_ms": 1e3 * percentile(gaps, 0.99),
            "stream_tokens_per_s_p50": percentile(speeds, 0.5)}


def worker_split(before: dict, after: dict, row: dict) -> dict:
    """Where the server's time went during a level, from its /health counters: rounds, ms per
    round (``Engine.step``: the GPU round, its one sync and the hand-over of tokens), of which
    handing tokens to the requests (detokenising, queueing), tokens per round, and the share of
    the level's wall time the worker thread was busy (admissions included)."""
    rounds = after["rounds"] - before["rounds"]
    wall = row["tokens"] / row["tokens_per_s"] if row["tokens_per_s"] else float("nan")
    return {"rounds": rounds, "round_ms": 1e3 * (after["round_s"] - before["round_s"]) / max(rounds, 1),
            "emit_ms": 1e3 * (after["emit_s"] - before["emit_s"]) / max(rounds, 1),
            "tokens_per_round": (row["tokens"] - row["requests"]) / max(rounds, 1),  # first tokens: prefills
            "worker_busy": (after["busy_s"] - before["busy_s"]) / wall}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="model directory (default: the default model)")
    p.add_argument("--draft", default=None)
    p.add_argument("--prompt-dir", required=True)
    p.add_argument("--prompt-chars", type=int, default=6000, help="characters of source code per prompt")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--requests", type=int, default=8,
                   help="requests per concurrency level at least (and 2 per client; default: 8)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--servers", default="none;hybrid;pld", help="';'-separated proposer arguments of each server")
    p.add_argument("--serve-args", default="", help="extra arguments of every server (e.g. --buckets 1,4,16,64)")
    p.add_argument("--startup-timeout", type=float, default=900, help="seconds a server may take to come up")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    rows = []
    for server in args.servers.split(";"):
        proposer = shlex.split(server)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "longspec.cli", "serve", "--port", str(port), "--max-batch", str(max(levels)),
               "--max-len", "4096", "--proposer", *proposer, *shlex.split(args.serve_args)]
        cmd += ["--target", args.target] if args.target else []
        cmd += ["--draft", args.draft] if args.draft and proposer[0] in ("longspec", "hybrid") else []
        proc = subprocess.Popen(cmd)
        url = f"http://127.0.0.1:{port}"
        try:
            started, deadline = time.perf_counter(), time.perf_counter() + args.startup_timeout
            while True:  # the server answers once it has loaded and warmed up every bucket
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.perf_counter() > deadline:
                    raise SystemExit(f"server {server!r} did not come up (exit code {proc.poll()})")
                time.sleep(0.5)
            print(f"{server:<40} ready after {time.perf_counter() - started:.1f} s (load + warm-up)", flush=True)
            prompts = code_prompts(Path(args.prompt_dir), 4, args.prompt_chars)
            asyncio.run(run_level(url, prompts[:2], 2, 8))  # warm-up: graph capture, caches
            for c in levels:
                result = run_level(url, code_prompts(Path(args.prompt_dir), max(args.requests, 2 * c),
                                                     args.prompt_chars), c, args.max_tokens)
                before = httpx.get(url + "/health", timeout=5).json()
                row = {"server": server, **asyncio.run(result)}
                row.update(worker_split(before, httpx.get(url + "/health", timeout=5).json(), row))
                rows.append(row)
                print(f"{server:<40} c={c:<3} {row['tokens_per_s']:8.1f} tok/s  ttft p50 {row['ttft_p50_ms']:7.1f} "
                      f"p99 {row['ttft_p99_ms']:7.1f} ms  itl p50 {row['itl_p50_ms']:6.1f} p99 {row['itl_p99_ms']:6.1f} ms  "
                      f"stream p50 {row['stream_tokens_per_s_p50']:7.1f} tok/s  | {row['rounds']} rounds: "
                      f"{row['round_ms']:.2f} ms each ({row['emit_ms']:.2f} handing tokens over), "
                      f"{row['tokens_per_round']:.2f} tokens; worker busy {100 * row['worker_busy']:.0f}%",
                      flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print(json.dumps({"max_tokens": args.max_tokens, "results": rows}))


if __name__ == "__main__":
    main()
