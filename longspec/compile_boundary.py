"""Functions that compiled steps call as they are (a graph break: Triton launches, in-place
writes into the KV pool), marked without importing TorchDynamo. ``torch.compiler.disable``
imports it, which costs a process seconds of its start even when it never compiles (``longspec
generate``, a CPU); :func:`compile_boundary` defers that to :func:`mark_compile_boundaries`,
which the first compiled step calls (``models.compiled.compile_step``)."""
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


class ShortCompileFailures:
    """A logging filter for TorchDynamo's "WON'T CONVERT" warning (a step Inductor cannot compile
    runs uncompiled: ``compile_step``'s ``suppress_errors``): one line per failing function and
    error, instead of Dynamo's ~300 lines of two tracebacks on every failure, and none of
    Inductor's dump of the node it could not generate code for; all of it with
    ``LONGSPEC_COMPILE_VERBOSE=1`` (``torch._dynamo.config.verbose`` alone is shortened too). A
    failure already reported (the same function and error) is not repeated."""

    def __init__(self):
        self.seen: set = set()

    def filter(self, record) -> bool:
        import os

        message = str(record.msg)
        if os.environ.get("LONGSPEC_COMPILE_VERBOSE") == "1":
            return True
        if message.startswith("Error in codegen for"):  # Inductor's dump of the node it failed on
            return False  # (~25 lines; the failure is then Dynamo's warning, shortened below)
        if not message.startswith("WON'T CONVERT"):
            return True
        where = message.splitlines()[0][len("WON'T CONVERT "):].strip()
        err = record.exc_info[1] if record.exc_info else None
        seen_errors = set()  # (a chain of causes that loops back ends there)
        while err is not None and id(err) not in seen_errors and \
                (err.__cause__ or getattr(err, "inner_exception", None)) is not None:
            seen_errors.add(id(err))
            err = err.__cause__ or err.inner_exception  # the compiler's own error, not Dynamo's wrapper
        lines = str(err).strip().splitlines() if err is not None else []
        why = f"{type(err).__name__}: {lines[0][:200]}" if lines else type(err).__name__ if err else "unknown error"
        if (where, why) in self.seen:
            return False
        self.seen.add((where, why))
        record.msg, record.args, record.exc_info, record.exc_text = (
            f"longspec: torch.compile could not compile {where} ({why}); it runs uncompiled (same results, "
            "slower). LONGSPEC_COMPILE_VERBOSE=1 prints the full trace", (), None, None)
        return True


def shorten_compile_failures() -> None:
    """Installs :class:`ShortCompileFailures` on TorchDynamo's and Inductor's loggers (once)."""
    import logging

    short = ShortCompileFailures()
    for name in ("torch._dynamo.convert_frame", "torch._inductor.scheduler"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, ShortCompileFailures) for f in logger.filters):
            logger.addFilter(short)
