"""Rank 0 drives, the other ranks mirror: :class:`Driver` starts ``world - 1`` follower processes
(one device each), keeps the calling process as rank 0, and every rank builds the same object
(``build(spec, tp)``: a Generator, a serving engine, over the rank's share of the target). Each
call the driver makes on its object (:meth:`Driver.call`) is broadcast to the followers, which
make the same call on theirs, in the same order, so every rank runs the same steps with the same
tokens. After each call the ranks compare a digest of their results, so a rank that went its own
way is an error, not silent garbage.

A follower that dies is noticed: :meth:`Driver.call` then raises a clear error at once (no
collective waits for it), and :meth:`Driver.watch` calls back as soon as it exits."""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
import threading
import weakref
from multiprocessing.connection import wait as wait_for_exit
from typing import Callable, Optional

import torch

from .group import TensorParallel, join


class WorkerDied(RuntimeError):
    """A follower process of a tensor-parallel group exited: the group cannot run any more."""


def digest(result, error: Optional[BaseException]) -> str:
    """What the ranks compare after a call: its result's tokens (a GenerationOutput's sequences,
    or the result itself: calls return tokens, not timings), or the error."""
    if error is not None:
        return f"error {type(error).__name__}: {error}"
    tokens = getattr(result, "sequences", result)
    return hashlib.sha256(repr(tokens).encode()).hexdigest()


def run_call(obj, call) -> tuple:
    """Runs ``call`` = (method name, args, kwargs) on ``obj``: (result, None) or (None, error)."""
    name, args, kwargs = call
    try:
        with torch.inference_mode():
            return getattr(obj, name)(*args, **kwargs), None
    except Exception as err:  # noqa: BLE001 - every rank reports it; the driver raises it
        return None, err


def follow(rank: int, world: int, init_method: str, device: str, build: Callable, spec) -> None:
    """A follower process: joins the group, builds its object, then makes every call the driver
    broadcasts until it broadcasts None (or the driver is gone: the broadcast then fails)."""
    tp = join(rank, world, init_method, device)
    try:
        try:
            obj, error = build(spec, tp), None
        except Exception as err:  # noqa: BLE001 - reported to the driver
            obj, error = None, err
        if any(tp.gather_objects(None if error is None else repr(error))):
            return
        while True:
            try:
                call = tp.broadcast()
            except RuntimeError as err:  # (gloo: "Connection closed by peer")
                print(f"[longspec: tensor-parallel rank {rank}: rank 0 is gone, stopping ({str(err)[:200]})]",
                      file=sys.stderr, flush=True)
                raise SystemExit(1) from None
            if call is None:
                return
            tp.gather_objects(digest(*run_call(obj, call)))
    finally:
        tp.close()


class Driver:
    """Rank 0 of ``world`` processes (``device`` "cuda": rank r on ``cuda:r``, NCCL; "cpu": gloo),
    each holding ``build(spec, tp)`` (``build`` a module-level function, ``spec`` picklable: the
    followers are spawned). ``obj``: this rank's object. Keyword arguments named in ``local``
    (e.g. a streamer) are passed on this rank only. Call :meth:`close` to stop the followers."""

    def __init__(self, build: Callable, spec, world: int, device: str, local: tuple = ()):
        self.local, self.failure = frozenset(local), None
        self._dir = tempfile.mkdtemp(prefix="longspec-tp-")
        init = f"file://{os.path.join(self._dir, 'store')}"
        context = torch.multiprocessing.get_context("spawn")
        self.workers = [context.Process(target=follow, args=(r, world, init, device, build, spec), daemon=True,
                                        name=f"longspec-rank{r}") for r in range(1, world)]
        for w in self.workers:
            w.start()
        self.tp = join(0, world, init, device)
        self._closed = False
        self._finalizer = weakref.finalize(self, _shut_down, self.tp, self.workers, self._dir)
        try:
            self.obj, error = build(spec, self.tp), None
        except Exception as err:  # noqa: BLE001 - raised after the followers hear of it
            self.obj, error = None, err
        failures = [e for e in self.tp.gather_objects(None if error is None else repr(error)) if e]
        if failures:
            self.close(stop_workers=False)
            if error is not None:
                raise error
            raise RuntimeError(f"a tensor-parallel worker failed to start: {failures[0]}")

    def call(self, name: str, *args, **kwargs):
        """``obj.<name>(*args, **kwargs)`` on every rank; returns this rank's result. Raises the
        call's error (every rank had it), RuntimeError if the ranks' results differ, and
        :class:`WorkerDied` once a follower has exited."""
        if self._closed:
            raise RuntimeError("this tensor-parallel group is closed")
        self.check_workers()
        shared = {k: v for k, v in kwargs.items() if k not in self.local}
        try:
            self.tp.broadcast((name, args, shared))
            result, error = run_call(self.obj, (name, args, kwargs))
            digests = self.tp.gather_objects(digest(result, error))
        except Exception:  # a collective failed: if a follower is gone, say so
            self.check_workers(wait_s=5.0)
            raise
        if len(set(digests)) > 1:
            raise RuntimeError(f"tensor-parallel ranks disagree after {name}: {digests}")
        if error is not None:
            raise error
        return result

    def check_workers(self, wait_s: float = 0.0) -> None:
        """Raises :class:`WorkerDied` if a follower has exited (waiting up to ``wait_s`` seconds
        for one to: a failed collective precedes its peer's exit code)."""
        if self.failure is None:
            wait_for_exit([w.sentinel for w in self.workers], timeout=wait_s)
            dead = [w for w in self.workers if w.exitcode is not None]
            if dead and not self._closed:
                self.failure = (f"tensor-parallel worker {dead[0].name} exited (exit code {dead[0].exitcode}): "
                                "the group cannot run any more; restart the process")
        if self.failure is not None:
            raise WorkerDied(self.failure)

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Calls ``on_death(message)`` from a background thread as soon as a follower exits while
        the group is open."""
        def run():
            wait_for_exit([w.sentinel for w in self.workers])
            if not self._closed:
                try:
                    self.check_workers()
                except WorkerDied as err:
                    on_death(str(err))

        threading.Thread(target=run, name="longspec-tp-watch", daemon=True).start()

    def close(self, stop_workers: bool = True) -> None:
        """Stops the followers (those still running) and leaves the process group."""
        if self._closed:
            return
        self._closed = True
        if self.failure is not None:  # the others wait for calls that will not come
            for w in self.workers:
                w.terminate()
        elif stop_workers:
            self.tp.broadcast(None)
        self._finalizer()


def _shut_down(tp: TensorParallel, workers: list, directory: str) -> None:
    for w in workers:
        w.join(timeout=60)
        if w.is_alive():
            w.terminate()
            w.join(timeout=10)
    tp.close()
    shutil.rmtree(directory, ignore_errors=True)
