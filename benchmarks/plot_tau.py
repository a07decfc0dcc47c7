"""Plots the JSON lines of ``tau_table.sh``: tau against prompt length, one line per proposer,
one panel per text kind and temperature.

    python benchmarks/plot_tau.py benchmarks/results/tau_table_cpu.log benchmarks/results/tau_table.png
"""
import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(log: str, out: str) -> None:
    runs = [json.loads(line) for line in open(log) if line.startswith("{")]
    panels = sorted({(r["text"], r["temperature"]) for r in runs})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), sharey=True, squeeze=False)
    for ax, (text, temp) in zip(axes[0], panels):
        lines = defaultdict(list)
        for r in runs:
            if (r["text"], r["temperature"]) == (text, temp):
                for row in r["results"]:
                    lines[f"{row['proposer']} {row['tree']}"].append((r["length"], row["tau"]))
        for label, pts in sorted(lines.items()):
            ax.plot(*zip(*sorted(pts)), marker="o", label=label)
        ax.set_title(f"{text}, {'greedy' if temp == 0 else f'T={temp:g}'}")
        ax.set_xlabel("prompt tokens")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("tau (tokens per round)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print("wrote", out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
