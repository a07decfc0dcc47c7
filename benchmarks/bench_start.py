"""Where a fresh ``longspec generate`` process spends its time: the wall time of the whole command
on one prompt, with cold on-disk compile caches (a new folder) and then warm ones (the same
folder), each status line it prints stamped with the seconds since the process started, plus the
floors no command can go under (importing torch and transformers, starting CUDA). Python's
bytecode cache is an on-disk cache too: an installed package normally has its ``.pyc`` files, but
an environment that sets ``PYTHONDONTWRITEBYTECODE`` compiles every module it imports in every
process (seconds for torch and transformers). ``--bytecode-cache`` (the default) lets the
commands write and read bytecode under a folder of this run (``PYTHONPYCACHEPREFIX``), so "warm"
means what it means on an ordinary install; ``--no-bytecode-cache`` keeps the environment as it
is. The floors are timed twice (the first time fills the bytecode cache). With
``--profile``, one more warm run under cProfile and its costliest functions (cumulative).

    python benchmarks/bench_start.py --target DIR --draft DIR --prompt-dir SRC --length 7600 \\
        --max-new-tokens 128 --profile

Prints the timelines and one JSON line last."""
from __future__ import annotations

import argparse
import json
import os
import pstats
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path



def timed_process(cmd: list, env: dict) -> dict:
    """Runs ``cmd``: its wall seconds, each stderr line with the second it arrived, its stdout."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []

    def read_stderr():
        for line in proc.stderr:
            lines.append((round(time.perf_counter() - t0, 2), line.rstrip()[:160]))

    reader = threading.Thread(target=read_stderr)
    reader.start()
    out = proc.stdout.read()
    proc.wait()
    reader.join()
    return {"wall_s": time.perf_counter() - t0, "rc": proc.returncode, "stderr": lines, "stdout": out}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--draft")
    p.add_argument("--prompt-dir", required=True, help="a source tree the prompt is cut from")
    p.add_argument("--length", type=int, default=7600)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--extra", default="", help="more `longspec generate` arguments, space separated")
    p.add_argument("--profile", action="store_true", help="one more warm run under cProfile")
    p.add_argument("--out", help="also write the JSON results to this file")
    p.add_argument("--bytecode-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="let the commands keep Python bytecode under this run's folder (default: on)")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from bench_generate import code_prompt

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    text = tokenizer.decode(code_prompt(tokenizer, Path(args.prompt_dir), args.length))
    work = Path(tempfile.mkdtemp(prefix="bench-start-"))
    prompt_file = work / "prompt.txt"
    prompt_file.write_text(text)
    home = work / "home"
    env = dict(os.environ, LONGSPEC_HOME=str(home))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    env.pop("TRITON_CACHE_DIR", None)
    if args.bytecode_cache:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(work / "bytecode")
    print(f"bytecode cache: {env.get('PYTHONPYCACHEPREFIX', 'as the environment has it')} "
          f"(PYTHONDONTWRITEBYTECODE={env.get('PYTHONDONTWRITEBYTECODE', 'unset')})", flush=True)
    gen = ["-m", "longspec.cli", "generate", "--target", args.target, "--prompt-file", str(prompt_file),
           "--max-new-tokens", str(args.max_new_tokens), "--json", *args.extra.split()]
    if args.draft:
        gen += ["--draft", args.draft]
    floors = {
        "import torch": [sys.executable, "-c", "import torch"],
        "import torch + transformers tokenizer": [sys.executable, "-c", "import torch, transformers; "
                                                  "from transformers import AutoTokenizer"],
        "import torch + CUDA start": [sys.executable, "-c", "import torch; torch.zeros(1, device='cuda'); "
                                     "torch.cuda.synchronize()"],
        "import longspec.cli.commands": [sys.executable, "-c", "import longspec.cli.commands"],
    }
    results = {}
    for name, cmd in floors.items():
        first, again = (round(timed_process(cmd, env)["wall_s"], 2) for _ in range(2))
        results[name] = [first, again]
        print(f"{name:>40}: {first:6.2f} s, again {again:6.2f} s", flush=True)
    runs = {}
    for name in ("cold", "warm", "warm again"):
        run = timed_process([sys.executable, *gen], env)
        runs[name] = run
        print(f"-- longspec generate, {name} caches: {run['wall_s']:.2f} s (rc {run['rc']})")
        for at, line in run["stderr"]:
            if line.startswith(("[longspec", "error", "Traceback")):  # (not the streamed text)
                print(f"   {at:7.2f}  {line}")
        if run["rc"] == 0:
            stats = json.loads(run["stdout"].strip().splitlines()[-1])["stats"]
            print(f"   stats: {stats}", flush=True)
    if args.profile:
        prof = work / "warm.prof"
        run = timed_process([sys.executable, "-m", "cProfile", "-o", str(prof), *gen], env)
        print(f"-- under cProfile (warm): {run['wall_s']:.2f} s; costliest functions, cumulative:")
        pstats.Stats(str(prof), stream=sys.stdout).sort_stats("cumulative").print_stats(45)
        print("-- by own time:")
        pstats.Stats(str(prof), stream=sys.stdout).sort_stats("tottime").print_stats(25)
    summary = {"floors_s": results, **{f"{k}_s": round(v["wall_s"], 2) for k, v in runs.items()},
               "timelines": {k: v["stderr"] for k, v in runs.items()}}
    if args.out:
        Path(args.out).write_text(json.dumps(summary))
    print(json.dumps({k: v for k, v in summary.items() if k != "timelines"}))


if __name__ == "__main__":
    main()
