"""Summarises the runs of ``benchmarks/ddp.sh``: per run, the median training throughput and the
held-out losses, printed; and a PNG with the training and held-out loss curves (the untrained
step 0 left out of the held-out panel, where it would flatten everything else).

    python benchmarks/plot_ddp.py DIR        # reads DIR/metrics_{one,two,two_b,killed,killed1}.jsonl
    python benchmarks/plot_ddp.py DIR FILE=LABEL ...   # any runs' metrics.jsonl, plotted to DIR/curves.png
"""
import json
import sys
from pathlib import Path

RUNS = {"one": "1 GPU", "two": "2 GPUs", "two_b": "2 GPUs again (run-to-run noise)", "killed": "2 GPUs, killed at step 50, resumed on 2",
        "killed1": "the same checkpoint resumed on 1 GPU"}


def main(directory: str, files: list = ()) -> None:
    out = Path(directory)
    runs = {}
    named = dict(item.split("=", 1) for item in files) if files else {str(out / f"metrics_{n}.jsonl"): n for n in RUNS}
    for file, name in named.items():
        path = Path(file)
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
        if rows:
            runs[name] = rows
    for name, rows in runs.items():
        speed = sorted(r["tokens_per_s"] for r in rows if "tokens_per_s" in r)
        evals = [(r["step"], round(r["eval_loss"], 4)) for r in rows if "eval_loss" in r]
        print(f"{name:8} median tokens/s {speed[len(speed) // 2] if speed else float('nan'):10.0f}  eval {evals}")
    if "one" in runs and "two" in runs:
        one, two = ([r["tokens_per_s"] for r in runs[n] if "tokens_per_s" in r] for n in ("one", "two"))
        print(f"2 GPUs / 1 GPU throughput: {sorted(two)[len(two) // 2] / sorted(one)[len(one) // 2]:.2f}x")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, (train_ax, eval_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in runs.items():
        train_pts = [(r["step"], r["loss"]) for r in rows if "loss" in r]
        eval_pts = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r and r["step"] > 0]
        if train_pts:
            train_ax.plot(*zip(*train_pts), label=RUNS.get(name, name), lw=1)
        if eval_pts:
            eval_ax.plot(*zip(*eval_pts), marker="o", label=RUNS.get(name, name))
    train_ax.set(xlabel="step", ylabel="training loss (mean of a logging window)", yscale="log")
    eval_ax.set(xlabel="step", ylabel="held-out loss")
    eval_ax.legend(fontsize=8)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "curves.png", dpi=110)
    print("wrote", out / "curves.png")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
