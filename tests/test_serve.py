"""`longspec serve` end to end: a real server process on a free port, queried with the official
`openai` client and raw HTTP. Completions and chat, streamed and not; 16 concurrent streaming
clients whose greedy outputs equal single-request runs; errors as OpenAI error objects with the
server still serving; a client that disconnects frees its row; a full queue answers 429; the
default model with its shipped draft."""
import asyncio
import json
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from longspec import GenerationConfig, load_target  # noqa: E402
from longspec.decoding.generator import Generator  # noqa: E402
from conftest import cyclic_garbage  # noqa: E402
from server_process import Server, copy_tokenizer  # noqa: E402


ServerProcess = Server  # (the server tests' name for it)


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_factory, tmp_path_factory):
    """A tiny random Llama with the default model's tokenizer (and chat template)."""
    from longspec.convert import default_gguf, default_model_dir

    try:
        default_gguf()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    smol = default_model_dir()
    _, path = tiny_model_factory("serve-tiny", "llama", vocab_size=49152, max_position_embeddings=1024, seed=3)
    copy_tokenizer(smol, path)
    return path


@pytest.fixture(scope="module")
def server(tiny_dir):
    proc = ServerProcess("--target", str(tiny_dir), "--model-name", "tiny", "--proposer", "pld",
                         "--max-batch", "4", "--max-len", "256", "--max-queue", "64",
                         "--prefill-chunk", "16")  # prompts in chunks (the other servers here: one eager prefill)
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def alone(tiny_dir):
    """Greedy tokens of one prompt generated alone (no server), to compare with."""
    target = load_target(tiny_dir)

    def run(ids, n):
        return Generator(target).generate([ids], GenerationConfig(max_new_tokens=n)).sequences[0]
    return run


def prompt_ids(i: int) -> list:
    gen = torch.Generator().manual_seed(i)
    base = torch.randint(0, 49152, (5,), generator=gen).tolist()
    return (base * 8)[:8 + 5 * i] + torch.randint(0, 49152, (3,), generator=gen).tolist()


def test_completion_and_chat(server, alone, tiny_dir):
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["tiny"]
    ids = prompt_ids(1)
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0)
    extension = out.model_extra["longspec"]
    assert extension["token_ids"] == alone(ids, 12)
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(extension["token_ids"])
    assert out.choices[0].finish_reason in ("length", "stop") and extension["tau"] >= 1.0
    timings = extension["timings_ms"]  # where its time to first token went on the server
    assert set(timings) == {"parse", "queue", "prefill", "send"} and timings["send"] is None  # (not streamed)
    assert min(timings["parse"], timings["queue"]) >= 0 and timings["prefill"] > 0
    streamed = list(client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0, stream=True))
    text = "".join(chunk.choices[0].text for chunk in streamed)
    assert text == out.choices[0].text
    assert streamed[-1].model_extra["longspec"]["timings_ms"]["send"] >= 0  # its first text out of the event loop
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                          temperature=0)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    chat_ids = tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                                       tokenize=False), add_special_tokens=False).input_ids
    assert chat.model_extra["longspec"]["token_ids"] == alone(chat_ids, 8)
    assert chat.choices[0].message.role == "assistant"
    pieces = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in pieces) == chat.choices[0].message.content
    whole = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=0)
    assert whole.usage.prompt_tokens + whole.usage.completion_tokens <= 256  # default: what the context allows
    assert whole.choices[0].finish_reason in ("length", "stop")


def test_stop_strings_and_sampling_parameters(server):
    client = server.client()
    ids = prompt_ids(2)
    full = client.completions.create(model="tiny", prompt=ids, max_tokens=20, temperature=0).choices[0].text
    if len(full) > 6:
        stop = full[3:6]
        cut = client.completions.create(model="tiny", prompt=ids, max_tokens=20, temperature=0, stop=[stop])
        assert cut.choices[0].text == full[:full.find(stop)] and cut.choices[0].finish_reason == "stop"
    sampled = [client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=1.0, top_p=0.9,
                                         seed=5, extra_body={"top_k": 20}) for _ in range(2)]
    assert all(s.usage.completion_tokens == 6 for s in sampled)
    assert sampled[0].model_extra["longspec"]["token_ids"] == sampled[1].model_extra["longspec"]["token_ids"]


def test_sixteen_concurrent_streams_each_equal_to_a_lone_run(server, alone):
    client = server.client(openai.AsyncOpenAI)

    async def one(i):
        greedy = i % 3 != 0
        n = 6 + i % 7
        stream = await client.completions.create(model="tiny", prompt=prompt_ids(i), max_tokens=n, stream=True,
                                                 temperature=0 if greedy else 0.8, top_p=0.95)
        last = None
        async for chunk in stream:
            last = chunk
        return i, greedy, n, last.model_extra["longspec"]["token_ids"], last.choices[0].finish_reason

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(16)))

    for i, greedy, n, tokens, reason in asyncio.run(all_of_them()):
        assert reason in ("length", "stop")
        if greedy:
            assert tokens == alone(prompt_ids(i), n), i
        else:
            assert 1 <= len(tokens) <= n
    assert server.health()["active"] == 0


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "x", "n": 2}, 400, "n"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": [1, 2, 99999999]}, 400, "prompt"),
    ({"prompt": "x " * 300, "max_tokens": 10}, 400, "max_tokens"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
])
def test_bad_requests_get_error_objects_and_the_server_keeps_serving(server, body, status, param):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    ok = server.client().completions.create(model="tiny", prompt="hello", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens >= 1


def test_client_disconnect_frees_its_row(server):
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": prompt_ids(3), "max_tokens": 200, "temperature": 0, "stream": True}) as r:
        lines = r.iter_lines()
        seen = 0
        for line in lines:
            if line.startswith("data:"):
                seen += 1
            if seen >= 2:
                break
    deadline = time.time() + 30
    while server.health()["active"] and time.time() < deadline:
        time.sleep(0.2)
    health = server.health()
    assert {k: health[k] for k in ("status", "active", "waiting")} == {"status": "ok", "active": 0, "waiting": 0}
    assert health["rounds"] >= 2 and health["busy_s"] >= health["round_s"] >= health["emit_s"] > 0


def test_full_queue_answers_429(tiny_dir):
    proc = ServerProcess("--target", str(tiny_dir), "--max-batch", "1", "--max-len", "256", "--max-queue", "1")
    try:
        client = proc.client(openai.AsyncOpenAI)

        async def one():
            try:
                await client.completions.create(model=tiny_dir.name, prompt="hello", max_tokens=60, temperature=0)
                return 200
            except openai.RateLimitError as err:
                assert err.body["code"] == "queue_full"
                return 429

        async def burst():
            return await asyncio.gather(*(one() for _ in range(6)))

        codes = asyncio.run(burst())
        assert 429 in codes and 200 in codes
    finally:
        proc.close()


def test_default_pair_with_the_shipped_draft():
    from longspec import LongSpecProposer, default_draft_path, default_model_path, load_draft

    try:
        smol = default_model_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    proc = ServerProcess("--proposer", "longspec", "--tree", "chain:3", "--max-batch", "2", "--max-len", "512")
    try:
        ids = list(range(100, 140))
        out = proc.client().completions.create(model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=10,
                                               temperature=0)
        target = load_target(smol)
        expected = Generator(target, proposer=LongSpecProposer(load_draft(default_draft_path(), target)),
                             tree="chain:3").generate([ids], GenerationConfig(max_new_tokens=10)).sequences[0]
        assert out.model_extra["longspec"]["token_ids"] == expected
    finally:
        proc.close()


def metaspace_tokenizer():
    """A SentencePiece-style tokenizer (Llama-2, Mistral): decoding drops the leading space of the
    first token, so "world" decodes alone to 'world' but after "hello" to ' world'."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "▁hello": 1, "▁world": 2, "!": 3, "▁foo": 4}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.mark.parametrize("kind", ["metaspace", "smollm2"])
def test_streamed_text_is_decoded_incrementally_and_adds_up_to_the_whole(kind):
    """The server decodes only each round's new tokens (with the previous piece as context), not
    the whole answer every round: the pieces, cut anywhere (inside a multi-byte character, before
    a token whose leading space a lone decode drops), add up to the answer decoded at once."""
    import random
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from longspec import default_model_path
    from longspec.serving.server import Worker

    rng = random.Random(0)
    if kind == "metaspace":
        tokenizer = metaspace_tokenizer()
        tokens = [rng.randrange(1, 5) for _ in range(80)]
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(default_model_path())
        except FileNotFoundError as err:
            pytest.skip(str(err))
        text = "déjà vu: 東京タワー 🚀🚀 naïve café\n\tdef f(x):  return x ** 2  # ✓ " * 3
        tokens = tokenizer(text, add_special_tokens=False).input_ids
        tokens += [rng.randrange(tokenizer.vocab_size) for _ in range(60)]
    worker = SimpleNamespace(tokenizer=tokenizer)
    whole = tokenizer.decode(tokens, skip_special_tokens=True)
    for trial in range(5):
        request = SimpleNamespace(seq=SimpleNamespace(tokens=[]), text="", prefix_offset=0, read_offset=0)
        while len(request.seq.tokens) < len(tokens):
            request.seq.tokens = tokens[:len(request.seq.tokens) + rng.randint(1, 4)]
            new, complete = Worker._new_text(worker, request)
            if complete:
                request.text += new
            else:
                assert "\ufffd" not in new
        if whole.endswith("\ufffd"):  # the random tail ends inside a character: held back
            assert whole.startswith(request.text)
        else:
            assert request.text == whole


@pytest.mark.parametrize("where", ["prefill", "proposer"])
def test_arrivals_are_prefilled_together_and_a_failure_fails_only_its_request(tiny_dir, alone, monkeypatch, where):
    """Requests admitted in one wave share one prefill (per run of free rows) instead of one each.
    When that fails (in the target's prefill, or in the proposer's set-up of one row after the
    prefill ran), only the failing request gets an error event; the others, retried alone where
    they were not set up, get their lone-run tokens."""
    from transformers import AutoTokenizer

    from longspec.engine.engine import Engine, Sequence
    from longspec.spec.proposers import PromptLookup
    from longspec.serving.server import Request, build_server

    target = load_target(tiny_dir)
    server = build_server(target, AutoTokenizer.from_pretrained(tiny_dir), "tiny", proposer=PromptLookup(),
                          tree="2,2", max_batch=6, max_len=256)
    loop = asyncio.new_event_loop()
    try:
        prompts = [prompt_ids(i) for i in range(5)]
        calls, real_add, real_setup = [], Engine.add, PromptLookup.add

        def add(engine, seqs, streamer=None, **kwargs):
            calls.append(len(seqs))
            if where == "prefill" and any(s.prompt == prompts[3] for s in seqs):
                raise RuntimeError("prefill failed")
            return real_add(engine, seqs, streamer, **kwargs)

        def setup(proposer, row, prompt, first_token, **kwargs):
            if list(prompt) == prompts[3]:
                raise RuntimeError("set-up failed")
            return real_setup(proposer, row, prompt, first_token, **kwargs)

        monkeypatch.setattr(Engine, "add", add)
        monkeypatch.setattr(PromptLookup, "add", setup)
        make = lambda p: Request(Sequence(p, 6, temperature=0.0), [], loop, asyncio.Queue())  # noqa: E731
        requests = [make(p) for p in prompts]
        server.worker._admit(requests[:2])
        assert calls == [2]  # a wave of arrivals: one prefill
        server.worker._admit(requests[2:])
        # the failed wave, then alone: every request (prefill) / the one after the failed row (proposer)
        assert calls == ([2, 3, 1, 1, 1] if where == "prefill" else [2, 3, 1])
        while server.engine.has_active:
            server.engine.step(streamer=server.worker._on_tokens)
        loop.run_until_complete(asyncio.sleep(0))
        errors = [r for r in requests if any(k == "error" for k, _ in
                                              (r.events.get_nowait() for _ in range(r.events.qsize())))]
        assert errors == [requests[3]]
        ok = [0, 1, 2, 4]
        assert [requests[i].seq.tokens for i in ok] == [alone(prompts[i], 6) for i in ok]
        engine = server.engine  # (no row kept blocks: the rows prefilled after a failed one gave theirs back)
        assert all(blocks is None for blocks in engine.cache.blocks) and not engine.has_active
    finally:
        server.worker.stop()
        loop.close()


def test_a_stop_string_is_found_while_a_character_is_held_back(tiny_dir):
    """A round that ends inside a multi-byte character still ends the answer at a stop string
    before it, and so does the last flush of a request that ends there."""
    from transformers import AutoTokenizer

    from longspec.engine.engine import Sequence
    from longspec.serving.server import Request, build_server

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    ids = tokenizer("hello STOP there 🚀", add_special_tokens=False).input_ids
    cut = next(k for k in range(len(ids), 0, -1) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    server = build_server(load_target(tiny_dir), tokenizer, "tiny", max_batch=1, max_len=64)
    loop = asyncio.new_event_loop()
    try:
        for last_flush in (False, True):
            request = Request(Sequence([1, 2, 3], 50, temperature=0.0), ["STOP"], loop, asyncio.Queue())
            request.seq.tokens, request.seq.row = ids[:cut], 0
            server.worker.running[id(request.seq)] = request
            if last_flush:  # the request ended (length) in that round, before its text was read
                server.worker._finish(request, "length")
            else:
                server.worker._on_tokens(0, ids[:cut])
                server.worker._finish(request, request.finish_reason)
            loop.run_until_complete(asyncio.sleep(0))
            events = [request.events.get_nowait() for _ in range(request.events.qsize())]
            assert "".join(v for k, v in events if k == "text") == "hello " and events[-1] == ("done", "stop")
    finally:
        server.worker.stop()
        loop.close()


@pytest.mark.parametrize("flag, compiled", [([], True), (["--no-compile"], False)])
def test_serve_no_compile_serves_uncompiled_steps(tiny_dir, monkeypatch, flag, compiled):
    """``--no-compile``: the server's target steps and proposals are not fused through
    torch.compile (CUDA graphs of eager steps; a shorter start-up). The target is loaded as on CUDA (compiled by
    default); the server is built, not run."""
    import longspec
    from longspec.cli import main, serve_command

    load = longspec.load_target

    def as_on_cuda(*args, **kwargs):
        target = load(*args, **kwargs)
        target.compile_steps = True
        return target

    seen = {}

    def built(args, sock, server, *rest):
        engine = server.engine
        round_rows = engine.view(engine.buckets[0])
        seen.update(compiled=engine.target.compile_steps,
                    proposals_compiled=round_rows.propose != round_rows.proposer.propose)
        return 0

    monkeypatch.setattr(longspec, "load_target", as_on_cuda)
    monkeypatch.setattr(serve_command, "_serve", built)
    main(["serve", "--target", str(tiny_dir), "--proposer", "pld", "--device", "cpu", "--max-len", "256",
          "--bucket-trees", "off", *flag])
    # a server compiles its proposals with its steps (a Generator's engine does not: see Engine)
    assert seen == {"compiled": compiled, "proposals_compiled": compiled}


def test_serve_warm_up_reports_each_part(tiny_dir, monkeypatch, capsys):
    """``--warm-up on``: the buckets are prepared before the server answers, and the status line
    after it gives the seconds of each part (the prefill, each bucket's rounds)."""
    import uvicorn

    from longspec.cli import main

    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)  # built, not run
    assert main(["serve", "--target", str(tiny_dir), "--proposer", "pld", "--device", "cpu", "--max-len", "256",
                 "--max-batch", "2", "--bucket-trees", "off", "--warm-up", "on"]) == 0
    line = next(x for x in capsys.readouterr().err.splitlines() if "batch buckets [1, 2] prepared in" in x)
    assert "the prefill " in line and "bucket 1's greedy rounds " in line and "bucket 2's greedy rounds " in line
    assert "garbage collection " in line


@pytest.mark.parametrize("warm_up", ["off", "on"])
def test_serve_keeps_what_lives_at_its_start_out_of_the_garbage_collector_while_it_serves(tiny_dir, monkeypatch,
                                                                                          warm_up, automatic_gc_off):
    """While the server runs, the objects alive when it started (the model, its compiled steps)
    are frozen (``gc.freeze``: no full collection scans them mid-request), garbage made before it
    is collected first (by the warm-up's collection, or its own), and everything is unfrozen once
    it stops."""
    import gc

    import uvicorn

    from longspec.cli import main

    gone = cyclic_garbage()  # (no automatic collection before the server's own)
    frozen = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: frozen.append((gc.get_freeze_count(), gone())))
    assert main(["serve", "--target", str(tiny_dir), "--proposer", "pld", "--device", "cpu", "--max-len", "256",
                 "--bucket-trees", "off", "--warm-up", warm_up]) == 0
    (count, cycle), = frozen
    assert count > 1000 and cycle is None
    assert gc.get_freeze_count() == 0


def test_a_wave_of_waiting_requests_matches_each_prompt_against_the_prefix_cache_twice(tiny_dir, monkeypatch):
    """The worker admitting k waiting requests matches each prompt once to see whether it fits
    (not once per request after it: k^2 / 2 matches of long prompts) and the admission once more."""
    from transformers import AutoTokenizer

    from longspec.engine.engine import Sequence
    from longspec.kv.prefix_cache import PrefixCache
    from longspec.serving.server import Request, build_server

    matched, real_match = [], PrefixCache.match
    monkeypatch.setattr(PrefixCache, "match", lambda self, prompt, namespace=None: matched.append(1)
                        or real_match(self, prompt, namespace))
    server = build_server(load_target(tiny_dir), AutoTokenizer.from_pretrained(tiny_dir), "tiny", max_batch=8,
                          max_len=128)
    loop = asyncio.new_event_loop()
    try:
        requests = [Request(Sequence(prompt_ids(i), 3, temperature=0.0), [], loop, asyncio.Queue())
                    for i in range(8)]
        with server.worker.lock:  # they all wait before the worker looks
            for request in requests:
                server.worker.submit(request)
        deadline = time.monotonic() + 60
        while any(not r.seq.done for r in requests) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(r.seq.done for r in requests) and len(matched) == 2 * len(requests)
    finally:
        server.worker.stop()
        loop.close()


def test_the_prefill_time_of_a_request_whose_run_went_before_a_failed_one(tiny_dir, monkeypatch):
    """Two requests admitted together into rows 0 and 2 (two runs of rows): the second run's
    prefill fails and that request is retried alone; the first one, prefilled and running on, has
    the time of its own run's first token (not none, not a negative number)."""
    from transformers import AutoTokenizer

    from longspec.engine.engine import Sequence
    from longspec.serving.server import Request, build_server

    server = build_server(load_target(tiny_dir), AutoTokenizer.from_pretrained(tiny_dir), "tiny", max_batch=3,
                          max_len=64)
    server.worker.stop()  # driven by hand below
    engine = server.engine
    x, y, z = (Sequence(prompt_ids(i), 30) for i in range(3))
    engine.add([x, y, z])
    engine.cancel(x), engine.cancel(z)
    assert engine.free_rows() == [0, 2]
    loop = asyncio.new_event_loop()
    try:
        first, second = (Request(Sequence(prompt_ids(3 + i), 20), [], loop, asyncio.Queue()) for i in range(2))
        real, runs = engine._prefill_rows, []

        def second_run_fails_once(seqs, row0):
            runs.append(row0)
            if len(runs) == 2:
                raise RuntimeError("out of memory")
            return real(seqs, row0)

        monkeypatch.setattr(engine, "_prefill_rows", second_run_fails_once)
        server.worker._admit([first, second])
        assert runs == [0, 2, 2] and first.seq.row == 0 and second.seq.row == 2
        for request in (first, second):
            timings = request.timings_ms()
            assert timings["prefill"] is not None and timings["prefill"] >= 0 and timings["queue"] >= 0, timings
    finally:
        loop.close()


def test_the_engine_thread_runs_with_the_servers_cpu_threads(tiny_dir, monkeypatch):
    """``longspec serve`` on a CPU loads on one thread and gives its --threads to the engine's
    thread alone (two OpenMP pools made a decode step 1.4x slower): the worker sets them."""
    import threading

    from longspec.serving.server import build_server

    calls = []
    set_threads = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads",
                        lambda n: (calls.append((threading.current_thread().name, n)), set_threads(n))[1])
    server = build_server(load_target(tiny_dir), None, "tiny", max_batch=1, max_len=64, threads=3)
    try:
        deadline = time.time() + 10
        while not calls and time.time() < deadline:
            time.sleep(0.01)
        assert calls == [("longspec-engine", 3)]
    finally:
        server.worker.stop()


def test_the_app_stops_its_server_at_shutdown_through_fastapis_lifespan():
    """The app's shutdown goes through FastAPI's lifespan (``on_event`` is deprecated: it warned
    at every start): leaving the app stops the server."""
    import warnings

    from fastapi.testclient import TestClient

    from longspec.serving.http import create_app

    class Stub:
        stopped = False

        def stop(self):
            self.stopped = True

    stub = Stub()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        app = create_app(stub)
    with TestClient(app):
        assert not stub.stopped
    assert stub.stopped


def test_a_request_the_scheduler_refuses_fails_and_the_worker_lives_on(tiny_dir, monkeypatch):
    """Where the scheduler finds that the first waiting request can never join (blocks held by no
    sequence: an engine used outside it), that request gets an error instead of waiting forever,
    and the worker thread goes on serving the next one."""
    from transformers import AutoTokenizer

    from longspec.engine.engine import Sequence
    from longspec.engine.scheduler import Scheduler
    from longspec.kv.cache import PoolExhausted
    from longspec.serving.server import Request, build_server

    server = build_server(load_target(tiny_dir), AutoTokenizer.from_pretrained(tiny_dir), "tiny", max_batch=2,
                          max_len=128)
    real, calls = Scheduler.schedule, []

    def refuse_once(self):
        calls.append(1)
        if len(calls) == 1:
            raise PoolExhausted("KV pool exhausted with no sequence running")
        return real(self)

    monkeypatch.setattr(Scheduler, "schedule", refuse_once)
    loop = asyncio.new_event_loop()
    try:
        first, second = (Request(Sequence(prompt_ids(i), 3, temperature=0.0), [], loop, asyncio.Queue())
                         for i in range(2))
        with server.worker.lock:
            server.worker.submit(first)
            server.worker.submit(second)
        deadline = time.monotonic() + 30
        while not second.seq.done and time.monotonic() < deadline:
            time.sleep(0.01)
        loop.run_until_complete(asyncio.sleep(0))
        kinds = [first.events.get_nowait()[0] for _ in range(first.events.qsize())]
        assert kinds == ["error"] and second.seq.done and len(second.seq.tokens) == 3
        assert server.worker.thread.is_alive() and server.worker.stats()["waiting"] == 0
    finally:
        server.worker.stop()
        loop.close()
