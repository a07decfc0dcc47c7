"""Runs the phases of a decoding round eagerly or as captured CUDA graphs.

A phase is a function of no arguments that reads and writes only tensors that live as long as
the engine (the caches, the proposer's buffers, the engine's static inputs and outputs), with
shapes that never change: the first call runs it eagerly; on CUDA, ``capture`` records each
phase once and later rounds replay the recordings (one launch per phase instead of hundreds).
Capturing needs warm-up runs, which would advance the decoding state: ``state`` lists the
tensors to put back afterwards (caches are only written past the committed tokens, so they are
not part of it)."""
from __future__ import annotations

import contextlib
import gc
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ..kv.cache import KVCache
from ..spec.sampling import Uniforms
from ..spec.tree import TreeSpec


_CAPTURE_STREAMS: dict = {}  # device -> the side stream every capture on it runs on


def capture_stream(device: torch.device) -> "torch.cuda.Stream":
    """The side stream that warm-ups and captures on ``device`` run on: one per device, shared
    by every engine and measurement (cuBLAS keeps a workspace, tens of MiB on Hopper, per stream).
    A stream per engine, taken from PyTorch's pool of side streams, was tried: with torch 2.11 it
    made Python's collector segfault while freeing dead engines; one shared stream did not."""
    device = torch.device(device)
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[device]


@contextlib.contextmanager
def collector_paused():
    """Collects garbage once, then pauses Python's cyclic collector (and Dynamo's collection
    after each compilation) until the block ends. A dead engine (a reference cycle) still holding
    CUDA graphs, collected in the middle of a capture, resets its graphs there; that is not
    permitted while a stream captures and invalidates the capture (seen: a failed capture that
    left the CUDA generator in capture mode). PyTorch no longer collects before a
    capture, so every capture here runs inside this block."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    dynamo = sys.modules.get("torch._dynamo")
    no_gc_after_compile = (dynamo.config.patch(run_gc_after_compile=False)
                           if dynamo is not None and hasattr(dynamo.config, "run_gc_after_compile")
                           else contextlib.nullcontext())
    try:
        with no_gc_after_compile:
            yield
    finally:
        if enabled:
            gc.enable()


class PhaseRunner:
    """``phases``: the round's functions in order; ``uniforms``: the round's random numbers;
    ``timed``: record each phase's device time (``collect_times``). Warm-ups and captures run on
    :func:`capture_stream`."""

    def __init__(self, phases: Sequence[Callable[[], None]], state: Sequence[torch.Tensor], uniforms: Uniforms,
                 device: torch.device, cuda_graphs: bool, timed: bool = True,
                 reset: Optional[Callable[[], None]] = None):
        self.phases, self.state, self.uniforms = list(phases), list(state), uniforms
        self.reset = reset  # puts back host-side state a phase left half-done (after a failed capture)
        self.device = device
        self.cuda_graphs = cuda_graphs and device.type == "cuda"
        self.graphs: Optional[list] = None
        self.random: Optional[torch.Tensor] = None  # the static random numbers its graphs read
        self.capture_s = 0.0  # time spent capturing (first round)
        self.times = [0.0] * len(self.phases)  # seconds per phase, summed over rounds
        self.timed = timed
        self._events: list = []

    def run_round(self) -> None:
        """Runs every phase once (capturing the graphs first if they are due). Nothing here waits
        for the device; ``collect_times`` must be called after the caller has synchronised."""
        self.prepare()
        self.uniforms.buffer = self.random  # this runner's own buffer (None: eager draws)
        self.uniforms.refill()
        if self.device.type == "cuda" and not self.timed:
            for i, phase in enumerate(self.phases):
                self.graphs[i].replay() if self.graphs else phase()
        elif self.device.type == "cuda":
            events = [torch.cuda.Event(enable_timing=True) for _ in range(len(self.phases) + 1)]
            stream = torch.cuda.current_stream(self.device)  # not the current device's: cuda:1 may run while cuda:0 is current
            events[0].record(stream)
            for i, phase in enumerate(self.phases):
                self.graphs[i].replay() if self.graphs else phase()
                events[i + 1].record(stream)
            self._events.append(events)
        else:
            t = time.perf_counter()
            for i, phase in enumerate(self.phases):
                phase()
                now = time.perf_counter()
                self.times[i] += now - t
                t = now

    def prepare(self) -> None:
        """Captures the phases' graphs if they are due (eager runs first: compilation happens
        there). The state is put back afterwards."""
        if self.cuda_graphs and self.graphs is None:
            self._capture()

    def collect_times(self) -> None:
        """Adds the device time of the rounds the device has finished since the last call (a round
        launched ahead may still run: its times wait for a later call)."""
        while self._events and self._events[0][-1].query():
            events = self._events.pop(0)
            for i in range(len(self.phases)):
                self.times[i] += events[i].elapsed_time(events[i + 1]) / 1000.0

    def _capture(self) -> None:
        """Captures with the process's random numbers, not the caller's seeded generators (the
        engine's or a row's): a seed's draws do not depend on whether a round was captured before."""
        u = self.uniforms
        seeded, rows, u.generator, u.row_generators = u.generator, u.row_generators, None, {}
        try:
            self._capture_phases()
        finally:
            u.generator, u.row_generators = seeded, rows

    def _capture_phases(self) -> None:
        t0 = time.perf_counter()
        saved = [t.clone() for t in self.state]

        def restore():
            for t, s in zip(self.state, saved):
                t.copy_(s)

        self.uniforms.eager()  # sizing run: how many random numbers a round takes
        for phase in self.phases:
            phase()
        self.uniforms.make_static(self.uniforms.used)
        restore()
        stream = capture_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up on a side stream, as capture requires
            self.uniforms.refill()
            for phase in self.phases:
                phase()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        restore()
        pool = torch.cuda.graph_pool_handle()
        graphs = []
        self.uniforms.refill()
        phase = None
        try:
            with collector_paused():
                for phase in self.phases:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        phase()
                    graphs.append(graph)
        except RuntimeError as err:  # an op that cannot be captured: stay correct, run eagerly
            name = getattr(getattr(phase, "func", phase), "__qualname__", repr(phase))
            cause = f" (first: {err.__context__})" if err.__context__ is not None else ""
            warnings.warn(f"CUDA-graph capture of {name} failed, this engine runs eagerly: {err}{cause}")
            graphs, self.cuda_graphs = None, False
            self.uniforms.eager()
            if self.reset is not None:
                self.reset()
        restore()
        torch.cuda.synchronize(self.device)
        self.graphs, self.random = graphs, self.uniforms.buffer
        self.capture_s = time.perf_counter() - t0


def graph_of(fn: Callable[[], None], device: Optional[torch.device] = None, inner: int = 1) -> "torch.cuda.CUDAGraph":
    """``inner`` calls of ``fn`` captured in one CUDA graph, after two warm-up calls on the
    capture stream (a benchmark's or a profile's replays)."""
    stream = capture_stream(device if device is not None else torch.device("cuda"))
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with collector_paused(), torch.cuda.graph(graph, stream=stream):
        for _ in range(inner):
            fn()
    return graph


def time_graph(fn: Callable[[], None], replays: int = 50, device: Optional[torch.device] = None,
               inner: int = 1) -> float:
    """Median seconds of one call of ``fn``: ``inner`` calls captured in one CUDA graph
    (:func:`graph_of`), CUDA events per replay, divided by ``inner``."""
    import statistics

    graph = graph_of(fn, device, inner)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(device))
        graph.replay()
        end.record(torch.cuda.current_stream(device))
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / inner)
    return statistics.median(times)


def batch_buckets(max_batch: int, given: Optional[Sequence[int]] = None) -> list:
    """Batch sizes a round may run at, ascending: ``given`` (default: powers of two below
    ``max_batch``), and always ``max_batch``."""
    if given is None:
        given = [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch]
    return sorted(set(given) | {max_batch})


@dataclass
class RoundRows:
    """Batch rows ``0..n-1`` of an engine, as one round over that bucket sees them: views that
    share the engine's storage (``proposer``: its proposer over the same rows, ``propose`` its
    possibly compiled ``propose``)."""

    n: int
    cache: KVCache
    root: torch.Tensor
    active: torch.Tensor
    out_tokens: torch.Tensor
    out_counts: torch.Tensor
    proposer: object = None
    propose: Optional[Callable] = None
    tree: Optional[TreeSpec] = None  # what the bucket's rounds draft
    follows: bool = False  # plain rounds keep the proposer up (a plain bucket of a speculative engine)
    draft_tree: object = None
