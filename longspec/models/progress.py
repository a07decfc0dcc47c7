"""Progress of long prefills: a prompt of 128k tokens takes seconds on a GPU and minutes on a CPU,
and a command must not sit silent that long. Inside ``with prefill_progress(report)``, the
prefills (:meth:`TargetModel.prefill`'s chunks, :func:`~longspec.models.layer_prefill.prefill_by_layer`'s
layers) call ``report(done)`` with the fraction of the prompt's work done (0 < done <= 1) after
each piece, having waited for the device (so the fraction is true). Outside, they call nothing
and wait for nothing."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch

_REPORTERS: list = []


@contextmanager
def prefill_progress(report: Callable[[float], None]):
    """Prefills in this block report their progress to ``report`` (see the module docstring)."""
    _REPORTERS.append(report)
    try:
        yield
    finally:
        _REPORTERS.remove(report)


def report(done: float, device: torch.device) -> None:
    """Called by a prefill after a piece: waits for ``device``, then tells the listeners."""
    if not _REPORTERS:
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    for listener in list(_REPORTERS):
        listener(done)
