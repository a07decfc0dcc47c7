"""Functions that compiled steps call as they are (a graph break: Triton launches, in-place
writes into the KV pool), marked without importing TorchDynamo. ``torch.compiler.disable``
imports it, which costs a process 1-4 s of its start even when it never compiles (``longspec
generate``, a CPU); :func:`compile_boundary` defers that to :func:`mark_compile_boundaries`,
which the first compiled step calls (``models.target.compile_step``)."""
from __future__ import annotations

import functools

_BOUNDARIES: list = []


def compile_boundary(fn):
    """``fn`` as it is until compilation is set up, then under ``torch.compiler.disable``."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return call.run(*args, **kwargs)

    call.run = fn
    _BOUNDARIES.append(call)
    return call


def mark_compile_boundaries() -> None:
    """Puts every :func:`compile_boundary` function under ``torch.compiler.disable`` (once)."""
    import torch

    for call in _BOUNDARIES:
        if call.run is call.__wrapped__:
            call.run = torch.compiler.disable(call.__wrapped__)
