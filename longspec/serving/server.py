"""``longspec serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one
:class:`~longspec.engine.engine.Engine` with continuous batching.

One worker thread owns the engine: between rounds it admits the requests its
:class:`~longspec.engine.scheduler.Scheduler` lets join (a wave in one batched prefill) and ends
cancelled ones; each round advances
every active request; text is decoded incrementally (each round's new tokens). Every
request has its own sampling settings (a ``RowSampling`` engine), so a greedy request gets
exactly the tokens it would get alone. Text reaches the client through an asyncio queue, as
server-sent events when ``stream`` is true. A seeded request draws its random numbers from its
own generator, so its text does not depend on the requests decoded beside it.

Endpoints (:mod:`longspec.serving.http`): ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``, ``GET /health``. Extensions: ``top_k`` in requests; ``longspec`` (tau, token
ids) in responses. Request bodies are checked and tokenised by :mod:`longspec.serving.request`."""

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..engine.engine import Engine, Sequence
from ..engine.scheduler import Scheduler
from ..kv.cache import PoolExhausted
from .engine_calls import EngineCalls, build_engine
from .request import APIError, RequestParsing
from .tokenizing import PieceCache

@dataclass
class Request:
    """One request in flight: its sequence, stop strings, the text sent so far and where its
    events go (an asyncio queue of the server's event loop)."""

    seq: Sequence
    stop: list
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    text: str = ""
    sent: int = 0  # characters already handed to the client
    # incremental detokenisation: text decoded from tokens[prefix_offset:read_offset] is in `text`
    prefix_offset: int = 0
    read_offset: int = 0
    finish_reason: Optional[str] = None
    final: bool = False  # text is complete (cut at a stop string)
    cancelled: bool = False
    error: Optional[Exception] = None  # handing its text over failed (it leaves after the round)
    created: float = field(default_factory=time.time)
    checked: float = 0.0  # when the event loop last checked that the client is still connected
    # perf_counter seconds: its body arrived (default: when it was built, after parsing), it was
    # parsed, its prefill began, its first token was out of the engine and its first text left
    # the event loop (streamed)
    received: float = field(default_factory=time.perf_counter)
    parsed: float = field(default_factory=time.perf_counter)
    prefill_start: float = 0.0
    first_token: float = 0.0
    first_sent: float = 0.0

    def timings_ms(self) -> dict:
        """Where its time to first token went on the server, in ms: parsing the body (and
        tokenising), waiting for a row or KV blocks, its prefill up to its first token (that of
        its run of rows: requests admitted together are prefilled one run after another) and, for
        a streamed request, its first text's way from the engine's thread out of the event loop
        (``send``; None when not streamed)."""
        def ms(start, end):
            return round(1e3 * (end - start), 3) if start and end else None

        return {"parse": ms(self.received, self.parsed), "queue": ms(self.parsed, self.prefill_start),
                "prefill": ms(self.prefill_start, self.first_token), "send": ms(self.first_token, self.first_sent)}

    def push(self, event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Worker:
    """Runs the engine in a background thread (see the module docstring). ``calls``: how the
    engine's state changes (:class:`~longspec.serving.engine_calls.EngineCalls`, or under tensor
    parallelism the calls every rank repeats); ``engine`` is read directly."""

    def __init__(self, engine: Engine, tokenizer, max_queue: int, calls=None, threads: Optional[int] = None):
        self.engine, self.tokenizer, self.max_queue = engine, tokenizer, max_queue
        self.threads = threads  # the engine thread's PyTorch CPU threads (None: the default)
        self.calls = calls or EngineCalls(engine)
        self.scheduler = Scheduler(engine)  # decides who joins when (under the lock: requests arrive on other threads)
        self.queued: dict = {}  # Sequence id -> Request, of the sequences waiting in the scheduler
        self.parsing = 0  # requests taken for parsing, not yet queued (they count against the queue)
        self.parsed = 0  # requests parsed so far
        self.running: dict = {}  # Sequence id -> Request
        self.lock = threading.Condition()
        self.stopped = False
        self.failure: Optional[str] = None  # the engine cannot run any more (see fail_all)
        # engine rounds; seconds in them, in their hand-over of tokens (detokenising, queueing), in all the work
        self.rounds, self.round_s, self.emit_s, self.busy_s = 0, 0.0, 0.0, 0.0
        self._emitting = 0.0  # hand-over seconds since the last round began (admissions hand over too)
        self.thread = threading.Thread(target=self._loop, name="longspec-engine", daemon=True)
        self.thread.start()

    def take_for_parsing(self) -> None:
        """Counts a request about to be parsed against the queue: raises a 429 APIError when
        ``max_queue`` requests already wait (or are being parsed) beyond the free rows, before
        any of its work (a flood of large prompts would otherwise hold the single parsing thread
        however each ends). :meth:`parsing_done` follows, whatever the parse did."""
        with self.lock:
            self._refuse_if_full(self.parsing)
            self.parsing += 1

    def parsing_done(self, parsed: bool) -> None:
        with self.lock:
            self.parsing -= 1
            self.parsed += parsed

    def submit(self, request: Request) -> None:
        """Queues ``request``; raises a 429 APIError when ``max_queue`` requests already wait
        beyond the free rows (``max_queue`` 0: a request is taken only when a row is free)."""
        with self.lock:
            self._refuse_if_full(0)
            try:
                self.scheduler.submit([request.seq])
            except ValueError as err:  # (the parsing checked the same: it cannot happen from HTTP)
                raise APIError(400, str(err), code="context_length_exceeded") from None
            self.queued[id(request.seq)] = request
            self.lock.notify()

    def _refuse_if_full(self, parsing: int) -> None:
        """A 503 once the engine has failed; a 429 where ``max_queue`` requests (``parsing`` of
        them being parsed) already wait beyond the free rows."""
        if self.failure is not None:
            raise APIError(503, self.failure, code="engine_failed", kind="server_error")
        waiting = len(self.scheduler.waiting) + parsing
        if waiting >= self.max_queue + len(self.engine.free_rows()):
            raise APIError(429, f"the server is busy: all rows are in use and {waiting} requests "
                                f"are waiting", code="queue_full", kind="rate_limit_error")

    def cancel(self, request: Request) -> None:
        with self.lock:
            request.cancelled = True
            self.lock.notify()

    def stats(self) -> dict:
        """Requests active and waiting; rounds run, seconds spent in them (``Engine.step``), in
        their hand-over of tokens to the requests (part of the rounds) and in all the worker's work
        between waits (admissions too); rows free and rows drawing from their own generator."""
        with self.lock:
            return {"active": len(self.running), "waiting": len(self.scheduler.waiting), "parsing": self.parsing,
                    "parsed": self.parsed, "rounds": self.rounds,
                    "free_rows": len(self.engine.free_rows()),
                    "row_generators": len(self.engine.uniforms.row_generators),
                    "round_s": round(self.round_s, 4), "emit_s": round(self.emit_s, 4), "busy_s": round(self.busy_s, 4),
                    "kv_cache": self.cache_stats()}

    def cache_stats(self) -> dict:
        """The KV block pool: blocks total, free, cached (see ``PrefixCache.stats``), hit rate."""
        engine = self.engine
        if engine.prefix is not None:
            return {"prefix_cache": True, **engine.prefix.stats()}
        return {"prefix_cache": False, "blocks_total": engine.pool.num_blocks, "blocks_free": engine.pool.num_free,
                "block_size": engine.pool.block_size}

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            self.lock.notify()
        self.thread.join(timeout=10)

    def fail_all(self, message: str, status: int = 500, code: str = "engine_failed") -> None:
        """The engine cannot run any more (a tensor-parallel worker died; the server shuts down):
        every request waiting or running gets an error (``status``, ``code``) now (even while the
        engine thread is stuck in a collective), later ones a 503, and the engine thread stops."""
        error = APIError(status, message, code=code, kind="server_error")
        with self.lock:
            self.failure = message
            requests = [*self.queued.values(), *list(self.running.values())]
            self.scheduler.waiting.clear()
            self.queued.clear()
            self.lock.notify()
        for request in requests:
            request.push(("error", error))

    # ---- worker thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        """Schedule (under the lock), admit, run a round, settle the requests it finished."""
        if self.threads:
            torch.set_num_threads(self.threads)
        while True:
            with self.lock:
                while not self.stopped and not self.queued and not self.running and self.failure is None:
                    self.lock.wait()
                if self.stopped or self.failure is not None:
                    return
                for request in [r for r in self.queued.values() if r.cancelled]:
                    self.scheduler.drop(request.seq)
                    del self.queued[id(request.seq)]
                refused = None
                try:
                    admit = [self.queued.pop(id(s)) for s in self.scheduler.schedule()]
                except PoolExhausted as err:  # (it never fits: failed, not waited for forever)
                    admit, refused = [], (self.queued.pop(id(self.scheduler.waiting.popleft())), err)
                cancelled = [r for r in self.running.values() if r.cancelled]
            start = time.perf_counter()
            if refused is not None:
                self._fail(*refused)
            try:
                for request in cancelled:
                    self._finish(request, None)
                self._admit(admit)
                if self.running:
                    step_start, self._emitting = time.perf_counter(), 0.0
                    self.calls.step(streamer=self._on_tokens)
                    with self.lock:
                        self.rounds += 1
                        self.round_s += time.perf_counter() - step_start
                        self.emit_s += self._emitting
                    self._settle(list(self.running.values()))
            except Exception as err:  # noqa: BLE001 - a failed round fails its requests, the server lives on
                for request in list(self.running.values()):
                    self._fail(request, err)
            with self.lock:
                self.busy_s += time.perf_counter() - start

    def _admit(self, requests: list) -> None:
        """Prefills the admitted requests together (one forward per run of consecutive free rows:
        a wave of arrivals does not stall the running streams once per request). A failure fails
        only its request: a failed wave is retried one request at a time."""
        if not requests:
            return
        with torch.inference_mode():
            try:
                self._add(requests)
            except Exception as err:  # noqa: BLE001 - these requests only
                for request in requests:
                    row = request.seq.row
                    if len(requests) == 1 or (row >= 0 and not request.seq.done and not int(self.engine.active[row])):
                        self._fail(request, err)  # (a wave's request whose prefill ran, but not its proposer's set-up)
                    elif row < 0:  # not prefilled before the failure: alone now
                        try:
                            self._add([request])
                        except Exception as one_err:  # noqa: BLE001 - this request only
                            self._fail(request, one_err)
            self._settle(requests)

    def _add(self, group: list) -> None:
        """Prefills ``group`` (a seeded request draws from its own generator in the row it takes,
        so its text does not depend on its neighbours)."""
        start = time.perf_counter()
        for request in group:
            self.running[id(request.seq)] = request
            request.prefill_start = start
        self.calls.add([r.seq for r in group], streamer=self._on_tokens)
        done = time.perf_counter()
        for request in group:  # (those whose first token went out have its time: see _hand_over)
            if not request.first_token and request.seq.row >= 0:
                request.first_token = done

    def _settle(self, requests: list) -> None:
        """After an engine call: the requests that finished (or met a stop string, or failed to
        hand their text over) in it leave. (Never from a streamer: calls do not nest.)"""
        for request in requests:
            if id(request.seq) not in self.running:
                continue
            if request.error is not None:
                self._fail(request, request.error)
            elif request.seq.done or request.finish_reason is not None:
                self._finish(request, request.finish_reason or self._reason(request))

    def _on_tokens(self, row: int, tokens: list) -> None:
        start = time.perf_counter()
        try:
            self._hand_over(row)
        finally:
            self._emitting += time.perf_counter() - start

    def _hand_over(self, row: int) -> None:
        request = self._by_row(row)
        if request is not None and not request.first_token:
            request.first_token = time.perf_counter()
        if request is None or request.finish_reason is not None or request.error is not None:
            return
        try:
            new, complete = self._new_text(request)
            text, stopped = self._cut_at_stop(request, request.text + new)
            if stopped:  # (it leaves after the engine call)
                request.finish_reason, request.final = "stop", True
            elif not complete:  # it ends inside a character: wait for the next token
                return
            request.text = text
            if len(text) > request.sent:
                request.push(("text", text[request.sent:]))
                request.sent = len(text)
        except Exception as err:  # noqa: BLE001 - this request only (it leaves after the engine call)
            request.error = err

    @staticmethod
    def _cut_at_stop(request: Request, text: str) -> tuple:
        """(text up to the first stop string, whether there was one)."""
        cut = min((i for i in (text.find(s) for s in request.stop) if i >= 0), default=-1)
        return (text[:cut], True) if cut >= 0 else (text, False)

    def _new_text(self, request: Request) -> tuple:
        """(the text the tokens since the last call add, complete), decoding only from the previous
        piece's first token, not the whole answer every round (that grows with the answer, on the
        thread that runs the rounds). Decoding the previous piece and the previous piece + the new
        tokens from the same token keeps tokenizers that drop a piece's leading space consistent.
        While the tokens end inside a character, ``complete`` is False, the text is what precedes
        that character, and nothing is consumed (the next call decodes it again)."""
        tokens = request.seq.tokens
        decode = self.tokenizer.decode
        before = decode(tokens[request.prefix_offset:request.read_offset], skip_special_tokens=True)
        after = decode(tokens[request.prefix_offset:], skip_special_tokens=True)
        if after.endswith("\ufffd"):
            return (after[len(before):].rstrip("\ufffd") if after.startswith(before) else ""), False
        if after.startswith(before):
            request.prefix_offset, request.read_offset = request.read_offset, len(tokens)
            return after[len(before):], True
        # pieces that do not concatenate (rare): this once, from the whole answer
        full = decode(tokens, skip_special_tokens=True)
        request.prefix_offset, request.read_offset = 0, len(tokens)
        return (full[len(request.text):] if full.startswith(request.text) else ""), True

    def _by_row(self, row: int) -> Optional[Request]:
        for request in self.running.values():
            if request.seq.row == row:
                return request
        return None

    def _reason(self, request: Request) -> str:
        return "length" if len(request.seq.tokens) >= request.seq.max_new_tokens and not (
            request.seq.tokens and request.seq.tokens[-1] in request.seq.eos) else "stop"

    def _leave(self, request: Request) -> None:
        """Ends ``request``'s sequence and frees its row (and the row's generator) if it still
        holds it."""
        seq = request.seq
        held = seq.row >= 0 and self.engine.rows[seq.row] is seq
        seq.done = True
        self.running.pop(id(seq), None)
        if held:
            self.calls.cancel(seq.row)

    def _finish(self, request: Request, reason: Optional[str]) -> None:
        self._leave(request)
        if reason is None:  # cancelled: nobody is listening
            return
        if not request.final:  # characters held back while incomplete (a stop string may end there)
            request.text, stopped = self._cut_at_stop(
                request, self.tokenizer.decode(request.seq.tokens, skip_special_tokens=True))
            reason = "stop" if stopped else reason
            if len(request.text) > request.sent:
                request.push(("text", request.text[request.sent:]))
                request.sent = len(request.text)
        request.push(("done", reason))

    def _fail(self, request: Request, err: Exception) -> None:
        request.push(("error", APIError(500, f"generation failed: {err}", kind="server_error")))
        try:
            self._leave(request)
        except Exception:  # noqa: BLE001 - the engine itself failed (e.g. a tensor-parallel worker died)
            pass


class Server(RequestParsing):
    """Everything the HTTP handlers need: the model name, tokenizer, worker and limits
    (``calls``: see :class:`Worker`)."""

    def __init__(self, engine: Engine, tokenizer, model_name: str, max_queue: int = 64, calls=None,
                 on_stop=None, threads: Optional[int] = None):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.worker = Worker(engine, tokenizer, max_queue, calls, threads)
        self.pieces = PieceCache(tokenizer)  # a chat's earlier messages are not tokenised again
        self.on_stop = on_stop  # called once the worker has stopped (e.g. stopping worker processes)
        self.eos = frozenset(engine.target.config.eos_token_ids)
        # positions a request may use: the cache's rows, never beyond the model's positions
        self.max_len = min(engine.max_len, engine.target.config.max_position_embeddings)
        # the longest token's characters: a text over MARGIN * that * max_len characters has more
        # tokens than any request may hold, and is refused without tokenising it
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self.token_chars = max(map(len, vocab), default=0)

    def stop(self) -> None:
        """Stops the worker (the server is shutting down), then calls ``on_stop``."""
        self.worker.stop()
        if self.on_stop is not None:
            self.on_stop()


def build_server(target, tokenizer, model_name: str, proposer=None, tree=None, max_batch: int = 8,
                 max_len: int = 4096, max_queue: int = 64, buckets=None, bucket_trees=None,
                 prefill_chunk: Optional[int] = None, prefix_cache: bool = True,
                 pool_tokens: Optional[int] = None, threads: Optional[int] = None) -> Server:
    """An engine of ``max_batch`` rows of ``max_len`` slots with per-request sampling, and its
    worker. ``buckets``: the batch sizes rounds run at (default: powers of two up to ``max_batch``);
    ``bucket_trees``: {bucket: smaller tree, or None for plain rounds}; ``prefill_chunk``: prompts
    prefilled in graph-captured chunks of that many tokens; ``prefix_cache``: requests reuse the
    K/V of cached prompt prefixes; ``pool_tokens``: the KV pool's size (see :class:`Engine`);
    ``threads``: the engine thread's PyTorch CPU threads (see ``longspec serve``'s loading).
    Raises ValueError for a ``max_len`` beyond the model's positions or a negative ``max_queue``."""
    if max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {max_queue}")
    engine = build_engine(target, proposer, tree, max_batch, max_len, buckets, bucket_trees, prefill_chunk,
                          prefix_cache, pool_tokens)
    return Server(engine, tokenizer, model_name, max_queue, threads=threads)
