"""`longspec serve --tensor-parallel 2` on the CPU (two gloo processes, a tiny random Llama in
float32): concurrent clients get exactly the tokens of one process, greedy and seeded sampling,
with prompt lookup and with the hybrid proposer over a random draft; a client that disconnects
frees its row; the server shuts down without leaving processes behind; a worker process that
dies fails the requests with a clear error and the server exits instead of waiting for it."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from longspec import GenerationConfig, Generator, load_target  # noqa: E402
from longspec.models.checkpoint import save_draft  # noqa: E402
from server_process import Server  # noqa: E402
from test_draft import noisy_draft  # noqa: E402
from test_training_ddp import save_char_tokenizer  # noqa: E402

PROPOSERS = {"pld": ["--proposer", "pld", "--tree", "chain:3"],
             "hybrid": ["--proposer", "hybrid", "--tree", "2,2,1,1"]}
# prompts with repeats (prompt lookup finds matches), of different lengths
PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9, 7, 21, 5, 9, 13], [3, 4, 5, 6, 3, 4, 5], [40, 41, 42, 43, 40, 41]]


@pytest.fixture(scope="module")
def model(tiny_model_factory, tmp_path_factory):
    """(target folder with a character tokenizer, random draft folder)."""
    _, path = tiny_model_factory("tp-serve", "llama", vocab_size=161, max_position_embeddings=256, seed=3)
    save_char_tokenizer(path)
    draft = tmp_path_factory.mktemp("tp-serve-draft")
    save_draft(noisy_draft(load_target(path), window=16, seed=4), draft)
    return str(path), str(draft)


def start(model, proposer: str, *extra) -> Server:
    path, draft = model
    args = ["--target", path, "--device", "cpu", "--max-batch", "4", "--max-len", "128", *PROPOSERS[proposer]]
    return Server(*args, *(["--draft", draft] if proposer == "hybrid" else []), *extra)


def tokens(server: Server, body: dict) -> list:
    """The token ids of one completion (streamed: from the last chunk)."""
    if not body.get("stream"):
        r = server.post(body)
        assert r.status_code == 200, r.text
        return r.json()["longspec"]["token_ids"]
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "error" not in chunks[-1], chunks[-1]
    return chunks[-1]["longspec"]["token_ids"]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # (a zombie has exited)
    except OSError:
        return False


def assert_gone(pids: list) -> None:
    deadline = time.time() + 30
    while any(map(alive, pids)) and time.time() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in pids if alive(pid)], "processes left behind"


def concurrently(server: Server, bodies: list) -> list:
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda b: tokens(server, b), bodies))


BODIES = [{"prompt": PROMPTS[0], "max_tokens": 14, "temperature": 0},
          {"prompt": PROMPTS[1], "max_tokens": 9, "temperature": 0, "stream": True},
          {"prompt": PROMPTS[2], "max_tokens": 11, "temperature": 0},
          {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0.9, "top_k": 30, "seed": 7}]


def test_parallel_server_gives_one_process_tokens_and_stops_cleanly(model):
    """Three concurrent greedy clients (one streamed) get the tokens of a lone Generator; a
    client that disconnects frees its row; SIGTERM stops rank 0 and its worker process."""
    target = load_target(model[0])
    want = [Generator(target, "pld", "chain:3").generate([b["prompt"]], GenerationConfig(
        max_new_tokens=b["max_tokens"])).sequences[0] for b in BODIES[:3]]
    server = start(model, "pld", "--tensor-parallel", "2")
    try:
        children = server.descendants()
        assert children, "no worker process"
        assert concurrently(server, BODIES[:3]) == want
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          json={"prompt": PROMPTS[0], "max_tokens": 100, "temperature": 0, "stream": True}) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data:")
                if seen >= 2:
                    break
        deadline = time.time() + 30
        while server.health()["active"] and time.time() < deadline:
            time.sleep(0.2)
        assert server.health()["active"] == 0
        assert tokens(server, BODIES[0]) == want[0]  # (the ranks still agree after the cancellation)
    finally:
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(timeout=90)
    log = server.proc.stdout.read()
    assert code in (0, -signal.SIGTERM) and "Traceback" not in log, log  # (uvicorn re-raises the SIGTERM)
    assert_gone(children)


@pytest.mark.slow
@pytest.mark.parametrize("proposer", list(PROPOSERS))
def test_parallel_server_matches_one_process_server(model, proposer):
    """Greedy and seeded sampled requests, concurrent: the same tokens from two ranks as from one
    process; an unseeded sampled request works (the ranks share its random numbers, or the server
    reports that they disagree)."""
    outs = []
    for extra in ([], ["--tensor-parallel", "2"]):
        server = start(model, proposer, *extra)
        try:
            outs.append(concurrently(server, BODIES))
            if extra:
                assert len(tokens(server, {"prompt": PROMPTS[1], "max_tokens": 6, "temperature": 1.0})) == 6
        finally:
            server.close()
    assert outs[0] == outs[1]
    assert len(outs[0][3]) == 8


@pytest.mark.slow
def test_a_dead_worker_fails_requests_and_stops_the_server(model):
    server = start(model, "pld", "--tensor-parallel", "2")
    children = server.descendants()
    worker = next(pid for pid in children if b"spawn_main" in open(f"/proc/{pid}/cmdline", "rb").read())
    events, first = [], threading.Event()

    def stream():
        with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                          json={"prompt": PROMPTS[0], "max_tokens": 110, "temperature": 0, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    first.set()

    client = threading.Thread(target=stream)
    client.start()
    try:
        assert first.wait(60)
        os.kill(worker, signal.SIGKILL)
        start_s = time.time()
        client.join(timeout=60)
        assert not client.is_alive() and time.time() - start_s < 30
        assert "exited" in events[-1]["error"]["message"] and "longspec-rank1" in events[-1]["error"]["message"]
        assert server.proc.wait(timeout=60) == 1
    finally:
        if server.proc.poll() is None:
            server.close()
    assert_gone(children)
