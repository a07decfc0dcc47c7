"""Training checkpoints and the metrics log, laid out in the output directory as

::

    OUT/config.json, OUT/model.safetensors     the latest draft: ``load_draft(OUT, target)``
    OUT/train_config.json                      the TrainConfig of the run
    OUT/metrics.jsonl                          one JSON object per logged step / evaluation
    OUT/checkpoints/step-00000500/             draft weights (save_draft) + trainer_state.pt
    OUT/checkpoints/latest                     name of the newest complete checkpoint

A checkpoint directory is written under a temporary name and renamed when complete, then
``latest`` is replaced atomically: a kill at any moment leaves the previous checkpoint usable.
``trainer_state.pt`` holds only tensors and plain Python values (optimizer state, step, data
position, RNG states) and is read back with ``torch.load(weights_only=True)``: no arbitrary
pickle is ever executed.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch

from ..models.checkpoint import default_mode, load_state, save_draft, write_atomic
from ..outdir import remove_stale, temp_prefix

STATE_FILE = "trainer_state.pt"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
LATEST = "latest"


def latest_checkpoint(out) -> Optional[Path]:
    """The newest complete checkpoint directory of a run, or None."""
    root = Path(out) / CHECKPOINTS
    pointer = root / LATEST
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if (candidate / STATE_FILE).is_file():
            return candidate
    done = sorted(p for p in root.glob("step-*") if (p / STATE_FILE).is_file()) if root.is_dir() else []
    return done[-1] if done else None


def save_checkpoint(out, step: int, draft, state: dict, keep: int = 2) -> Path:
    """Writes ``checkpoints/step-XXXXXXXX`` (draft + ``state``), points ``latest`` at it, keeps
    the ``keep`` newest checkpoints, and refreshes the top-level draft of ``out``."""
    out = Path(out)
    root = out / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(name), dir=root))
    os.chmod(tmp, default_mode(directory=True))
    try:
        save_draft(draft, tmp)
        torch.save(state, tmp / STATE_FILE)
        final = root / name
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    write_atomic(root / LATEST, lambda f: Path(f).write_text(name + "\n"))
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-max(keep, 1)]:
        shutil.rmtree(old, ignore_errors=True)
    save_draft(draft, out)
    return final


def load_checkpoint(path, draft) -> dict:
    """Loads the draft weights of checkpoint ``path`` into ``draft`` (in place) and returns its
    trainer state (``torch.load(weights_only=True)``)."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    for key in ("window", "hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim"):
        if key in config and config[key] != getattr(draft.config, key):
            raise ValueError(f"cannot resume from {path}: it has {key}={config[key]}, this run "
                             f"{getattr(draft.config, key)}")
    load_state(draft, [path / "model.safetensors"])
    try:
        return torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as err:  # corrupt file, or content that is not plain tensors / values
        raise ValueError(f"cannot read {path / STATE_FILE}: {err}") from None


class MetricsLog:
    """Appends JSON rows to ``OUT/metrics.jsonl`` (main process only)."""

    def __init__(self, out, enabled: bool = True):
        self.path = Path(out) / METRICS_FILE
        self.enabled = enabled

    def truncate_after(self, step: int) -> None:
        """Drops rows logged after ``step`` (a resumed run redoes those steps), and a last line
        that a kill cut short."""
        if not (self.enabled and self.path.is_file()):
            return
        rows = [json.dumps(row) for row in self.read() if row.get("step", 0) <= step]
        write_atomic(self.path, lambda f: Path(f).write_text("".join(r + "\n" for r in rows)))

    def write(self, row: dict) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")

    def read(self) -> list:
        """The rows logged so far. A damaged last line (a kill while it was written) is left
        out; a damaged line before it raises ValueError naming the file and line."""
        if not self.path.is_file():
            return []
        lines = [(n, line) for n, line in enumerate(self.path.read_text(errors="replace").splitlines(), 1)
                 if line.strip()]
        rows = []
        for i, (n, line) in enumerate(lines):
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError("not a JSON object")
            except ValueError as err:
                if i == len(lines) - 1:
                    break
                raise ValueError(f"{self.path} line {n} is damaged ({err}): repair or delete that line") from None
            rows.append(row)
        return rows


def remove_leftovers(out) -> list:
    """Removes what killed runs left half-written in a run's folder and its checkpoints
    (temporary checkpoint folders, weight and config files); returns their paths."""
    return remove_stale(out) + remove_stale(Path(out) / CHECKPOINTS)
