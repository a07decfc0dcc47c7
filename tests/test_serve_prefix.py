"""`longspec serve` with its prefix cache (on by default), on real server processes: a request
after a cached document reads its blocks (``usage.prompt_tokens_details.cached_tokens``,
``/health``'s ``kv_cache``) and returns the tokens of a lone cold run; requests wait for KV blocks
when the pool (``--kv-memory``) is short instead of failing; a client that goes away while holding
shared blocks leaks none; ``--no-prefix-cache`` turns it off."""
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")  # (server_process imports it)
httpx = pytest.importorskip("httpx")

from longspec import GenerationConfig, load_target  # noqa: E402
from longspec.cli import main  # noqa: E402
from longspec.decoding.generator import Generator  # noqa: E402

from server_process import Server, copy_tokenizer  # noqa: E402

POOL = "0.0002GiB"  # 419 tokens of this model's K/V: 7 blocks of 64, two requests of 256 do not fit at once


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    from longspec.convert import default_gguf, default_model_dir

    try:
        default_gguf()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    _, path = tiny_model_factory("serve-prefix", "llama", vocab_size=49152, max_position_embeddings=1024, seed=4)
    copy_tokenizer(default_model_dir(), path)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    proc = Server("--target", str(model_dir), "--model-name", "m", "--proposer", "pld", "--max-batch", "2",
                  "--max-len", "256", "--kv-memory", POOL)
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def alone(model_dir):
    target = load_target(model_dir)
    gen = Generator(target, prefix_cache=False)
    return lambda ids, n: gen.generate([ids], GenerationConfig(max_new_tokens=n)).sequences[0]


def ids(seed: int, n: int) -> list:
    return [(1000 + 7919 * seed + 104729 * k) % 49152 for k in range(n)]


def complete(server, prompt, n=8, **kw) -> dict:
    r = server.post({"prompt": prompt, "max_tokens": n, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def settle(server) -> dict:
    """/health once no request is active; every block is free or cached and idle (none leaked)."""
    deadline = time.time() + 30
    while server.health()["active"] and time.time() < deadline:
        time.sleep(0.1)
    health = server.health()
    pool = health["kv_cache"]
    assert health["active"] == 0 and pool["blocks_free"] + pool["blocks_cached_idle"] == pool["blocks_total"], pool
    return health


def test_a_request_after_a_cached_document_reads_its_blocks(server, alone):
    doc = ids(1, 150)
    first = complete(server, doc + [5, 6])
    second = complete(server, doc + [7, 8, 9])
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # the whole document: two whole blocks and the first 22 tokens of the first request's last one (copied)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 150
    assert second["longspec"]["token_ids"] == alone(doc + [7, 8, 9], 8)
    pool = settle(server)["kv_cache"]
    assert pool["prefix_cache"] and pool["blocks_total"] == 7 and pool["block_size"] == 64
    assert pool["cached_tokens"] >= 150 and 0 < pool["hit_rate"] < 1


def test_a_chats_next_turn_reuses_the_tokens_and_the_blocks_of_its_first(server, model_dir, alone):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    doc = "Summarise: " + " ".join(f"line {k} of the notes says {k * 7 % 13}." for k in range(12))  # (~110 tokens)
    chat = [{"role": "user", "content": doc}]
    first = server.post({"messages": chat, "max_tokens": 4, "temperature": 0}, path="/v1/chat/completions").json()
    chat += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
             {"role": "user", "content": "Shorter?"}]
    second = server.post({"messages": chat, "max_tokens": 4, "temperature": 0}, path="/v1/chat/completions").json()
    prompt = tok(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
                 add_special_tokens=False).input_ids
    assert second["usage"]["prompt_tokens"] == len(prompt) and second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert second["longspec"]["token_ids"] == alone(prompt, 4)
    pieces = settle(server)["tokenizer_cache"]
    assert pieces["enabled"] and pieces["pieces"] >= 1 and pieces["hit_rate"] > 0.3  # (the second's document)


def test_requests_wait_for_blocks_when_the_pool_is_short(server, alone):
    """Two requests that need 4 blocks each against a pool of 7: the second waits for the first
    to end (not an error), and both get a lone run's tokens."""
    prompts = [ids(10 + i, 200) for i in range(2)]
    results = [None, None]

    def send(i):
        results[i] = complete(server, prompts[i], n=20)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [r["longspec"]["token_ids"] for r in results] == [alone(p, 20) for p in prompts]
    settle(server)


def test_a_client_that_goes_away_while_holding_shared_blocks_leaks_none(server, alone):
    doc = ids(3, 140)
    complete(server, doc + [1], n=2)  # cached
    kept = {}

    def other():
        kept["r"] = complete(server, doc + [3, 4], n=40)

    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": doc + [2], "max_tokens": 200, "temperature": 0, "stream": True}) as r:
        thread = threading.Thread(target=other)
        thread.start()
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data:")
            if seen >= 2:
                break  # gone, holding the document's blocks with the other request
    thread.join(timeout=120)
    assert kept["r"]["usage"]["prompt_tokens_details"]["cached_tokens"] == 140
    assert kept["r"]["longspec"]["token_ids"] == alone(doc + [3, 4], 40)
    settle(server)
    assert complete(server, doc + [9], n=2)["usage"]["prompt_tokens_details"]["cached_tokens"] == 140


def test_no_prefix_cache_and_a_pool_smaller_than_a_request(model_dir, capsys):
    assert main(["serve", "--target", str(model_dir), "--max-len", "256", "--kv-memory", "0.0001GiB",
                 "--device", "cpu"]) == 2
    assert "less than one request" in capsys.readouterr().err
    for amount, says in (("lots", "GiB (e.g. 8 or 8GiB)"), ("inf", "finite"), ("nan", "finite"),
                         ("1e6", "GiB free on cpu")):  # (each a clear message, not a traceback)
        assert main(["serve", "--target", str(model_dir), "--max-len", "256", "--kv-memory", amount,
                     "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, err
    proc = Server("--target", str(model_dir), "--max-len", "256", "--no-prefix-cache")
    try:
        doc = ids(4, 150)
        for tail in ([1], [2]):
            assert complete(proc, doc + tail, n=2)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert proc.health()["kv_cache"]["prefix_cache"] is False
    finally:
        proc.close()
