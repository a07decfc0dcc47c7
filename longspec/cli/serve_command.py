"""``longspec serve``: options checked, the target (or its tensor-parallel processes) loaded, the
batch buckets' trees chosen and warmed up, then the OpenAI-compatible server (``longspec/serving/server.py``)."""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from pathlib import Path

from ..status import Heartbeat, status
from .commands import UsageError, _device_and_dtype, _set_threads, _tensor_parallel, proposer_choice


def cmd_serve(args) -> int:
    """``longspec serve``: the OpenAI-compatible server (see ``longspec/serving/server.py``)."""
    with contextlib.ExitStack() as held:  # (the listening socket, closed however the command ends)
        return _cmd_serve(args, held)


def _cmd_serve(args, held) -> int:
    _set_threads(args)
    device, dtype = _device_and_dtype(args)
    name, tree = proposer_choice(args, device)
    if (args.max_batch < 1 or args.max_len < 2 or args.max_queue < 0 or (args.prefill_chunk or 0) < 0
            or args.max_body < 1 or not 0 <= args.shutdown_timeout < float("inf")):
        raise UsageError("--max-batch must be >= 1, --max-len >= 2, --max-queue >= 0, --prefill-chunk >= 0, "
                         "--max-body >= 1 and --shutdown-timeout a number of seconds >= 0")
    import os

    from_env = os.environ.get("LONGSPEC_API_KEY")
    api_keys = args.api_key if args.api_key is not None else from_env.split(",") if from_env is not None else []
    for key in api_keys:
        if not key.strip() or not key.isprintable():
            raise UsageError("--api-key (or LONGSPEC_API_KEY) must be printable and not empty")
        if key != key.strip():  # HTTP drops a header's surrounding whitespace: such a key could never be sent
            raise UsageError("--api-key (or LONGSPEC_API_KEY) has whitespace around it, which no client can send "
                             "(HTTP strips it from headers): give the key without it")
    if len(set(api_keys)) < len(api_keys):
        raise UsageError("an API key is given twice (each key is a tenant of its own)")
    if (args.prefill_chunk or 0) > args.max_len:
        raise UsageError(f"--prefill-chunk ({args.prefill_chunk}) must not exceed --max-len ({args.max_len})")
    buckets = None
    if args.buckets:
        try:
            buckets = sorted({int(b) for b in args.buckets.split(",")})
        except ValueError:
            raise UsageError(f"--buckets takes comma-separated batch sizes, got {args.buckets!r}") from None
        if buckets[0] < 1 or buckets[-1] > args.max_batch:
            raise UsageError(f"--buckets must lie in 1..--max-batch ({args.max_batch}), got {args.buckets}")
    parallel = _tensor_parallel(args, device)
    from ..decoding.bucket_choice import bucket_trees_option, choose_bucket_trees
    from ..serving.server import Server, build_server

    bucket_trees = bucket_trees_option(args.bucket_trees, name, tree, buckets, args.max_batch)
    if parallel and bucket_trees == "auto":  # (the cost model times steps on one device, not across ranks)
        bucket_trees = {}
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise UsageError(f"longspec serve needs FastAPI and uvicorn: pip install 'longspec[serve]' "
                         f"(importing them failed: {err})") from None
    sock = held.enter_context(listen_socket(args.host, args.port))  # (before loading: a taken port is said at once)
    from transformers import AutoTokenizer

    from .. import load_target
    from ..config import ModelConfig
    from ..convert import DEFAULT_NAME, default_model_dir
    from ..models.checkpoint import read_config

    if args.draft:
        read_config(args.draft)  # (a wrong --draft said now, not after loading the model)
    target_dir = Path(args.target) if args.target else default_model_dir(announce=True)
    positions = ModelConfig.from_hf(read_config(target_dir)).max_position_embeddings
    if args.max_len > positions:
        raise UsageError(f"--max-len {args.max_len} exceeds the model's {positions} positions "
                         "(max_position_embeddings): lower --max-len")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model_name = args.model_name or (DEFAULT_NAME if not args.target else target_dir.name)
    chunk = (args.prefill_chunk if args.prefill_chunk is not None
             else min(1024, args.max_len) if device.startswith("cuda") else 0)
    parallel_engine = None
    if parallel:
        import torch

        from ..parallel.serving import EngineSpec, ParallelEngine

        if args.kv_memory is not None:
            raise UsageError("--kv-memory does not work with --tensor-parallel yet (each process sizes its pool "
                             "within half its GPU's free memory)")
        status(f"loading {target_dir} on {parallel} {device} processes ({dtype}), tensor-parallel")
        parallel_engine = ParallelEngine(EngineSpec(
            str(target_dir), dtype, device, name, args.draft, None if tree is None else str(tree), args.window,
            torch.get_num_threads(), args.max_batch, args.max_len, buckets, bucket_trees, chunk or None,
            args.prefix_cache, args.compile), parallel)
        server = Server(parallel_engine.engine, tokenizer, model_name, args.max_queue, parallel_engine.calls,
                        on_stop=parallel_engine.close)  # (uvicorn re-raises SIGTERM after its shutdown)
    else:
        from ..spec.proposers import build_proposer

        threads = None
        if device == "cpu":
            # the engine runs in the server's worker thread; PyTorch's OpenMP gives every thread that
            # runs parallel work a pool of its own, and with two pools (this thread's from loading, the
            # worker's) more threads exist than cores and OpenMP barely spins between operations: a
            # decode step took a third longer. This thread loads on one core, the worker alone uses
            # --threads.
            import torch

            threads = torch.get_num_threads()
            torch.set_num_threads(1)
        status(f"loading {target_dir} on {device} ({dtype})")
        target = load_target(target_dir, dtype=dtype, device=device)
        target.compile_steps = target.compile_steps and args.compile
        pool_tokens = None
        if args.kv_memory is not None:
            from ..kv.cache import pool_tokens_for

            try:
                pool_tokens = pool_tokens_for(args.kv_memory, target.config, target.dtype, target.device)
            except ValueError as err:
                raise UsageError(f"--kv-memory: {err}") from None
            if pool_tokens < args.max_len:
                raise UsageError(f"--kv-memory {args.kv_memory} holds {pool_tokens} tokens of K/V, less than one "
                                 f"request of --max-len {args.max_len}: give more memory or lower --max-len")
        proposer = build_proposer(name, target, args.draft, window=args.window)  # (default: the shipped draft)
        if bucket_trees == "auto":
            if target.device.type == "cuda":
                status("choosing each batch bucket's tree (measures step costs once per device, cached)")
            with Heartbeat(lambda: "choosing each batch bucket's tree"):
                bucket_trees, notes = choose_bucket_trees(target, proposer, tree, buckets, args.max_batch,
                                                          args.max_len)
            if notes:
                print(f"[longspec: trees of the batch buckets, cost model: {notes}]", file=sys.stderr, flush=True)
        server = build_server(target, tokenizer, model_name, proposer, tree, max_batch=args.max_batch,
                              max_len=args.max_len, max_queue=args.max_queue, buckets=buckets,
                              bucket_trees=bucket_trees, prefill_chunk=chunk or None, prefix_cache=args.prefix_cache,
                              pool_tokens=pool_tokens, threads=threads)
    try:
        return _serve(args, sock, server, parallel_engine, name, tree, bucket_trees, api_keys, device, dtype)
    finally:
        if parallel_engine is not None:
            parallel_engine.close()


def listen_socket(host: str, port: int):
    """The server's socket, bound to ``host``:``port`` (0: a free port) and listening (so that a
    second server cannot take the port while this one loads: connections made meanwhile wait
    until it serves); a clear UsageError where it cannot be."""
    import socket

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except (OSError, OverflowError) as err:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {getattr(err, 'strerror', None) or err}") from None
    return sock


def _serve(args, sock, server, parallel_engine, name, tree, bucket_trees, api_keys, device, dtype) -> int:
    """Warms ``server`` up (if asked) and serves it on ``sock`` until the process is told to stop
    (or, under tensor parallelism, a worker process dies: exit code 1)."""
    import gc

    import uvicorn

    from ..serving.http import create_app

    model_name = server.model_name
    warm_up = args.warm_up == "on" or (args.warm_up == "auto" and device.startswith("cuda"))
    if warm_up:
        status(f"warming up batch buckets {server.engine.buckets} (compiling and capturing each: up to minutes on "
               "a GPU; the server answers once they are ready)")
        start = time.perf_counter()
        with Heartbeat(lambda: f"warming up {server.engine.warming or 'batch buckets'}"):
            server.worker.calls.warm_up()
        seconds = time.perf_counter() - start
        done = "compiled and captured" if server.engine.cuda_graphs and device.startswith("cuda") else "prepared"
        parts = ", ".join(f"{what} {s:.1f} s{_graphs(server.engine.warm_up_graphs.get(what))}"
                          for what, s in server.engine.warm_up_seconds.items())
        print(f"[longspec: batch buckets {server.engine.buckets} {done} in {seconds:.1f} s ({parts})]",
              file=sys.stderr, flush=True)
    plain = "plain decoding"
    port = sock.getsockname()[1]  # (the free port chosen for --port 0)
    print(f"[longspec: serving {model_name} on http://{args.host}:{port}/v1 ({device}, {dtype}, proposer "
          f"{name}{f' tree {tree}' if tree else ''}"
          f"{''.join(f', bucket {b}: {t or plain}' for b, t in sorted(bucket_trees.items()))}, "
          f"{args.max_batch} rows of {args.max_len} tokens, KV pool {server.engine.pool.num_blocks} blocks of "
          f"{server.engine.pool.block_size} tokens, prefix cache {'on' if server.engine.prefix else 'off'}"
          f"{f', API key required ({len(api_keys)} tenants)' if len(api_keys) > 1 else ', API key required' if api_keys else ''}"
          f"{f', tensor-parallel over {args.tensor_parallel} processes' if parallel_engine else ''})]",
          file=sys.stderr, flush=True)
    http = uvicorn.Server(uvicorn.Config(create_app(server, api_keys=api_keys, max_body=args.max_body), host=args.host,
                                         port=args.port, log_level=args.log_level,
                                         timeout_graceful_shutdown=args.shutdown_timeout + SHUTDOWN_GRACE))
    threading.Thread(target=_end_requests_after, args=(http, server, args.shutdown_timeout), name="longspec-shutdown",
                     daemon=True).start()
    if parallel_engine is not None:
        def on_death(message: str) -> None:  # every request fails now; the server stops (no rank can run)
            print(f"[longspec: {message}]", file=sys.stderr, flush=True)
            server.worker.fail_all(message)
            time.sleep(1.0)  # (the failed requests' answers go out first)
            http.should_exit = True

        parallel_engine.driver.watch(on_death)
    # what lives now (the model, the compiled steps: some 400,000 objects at the 8B shape) lives as
    # long as the server: out of the collector's reach, so that no full collection scans it
    # mid-request (the warm-up ends with a full collection: none again)
    if not warm_up:
        gc.collect()
    gc.freeze()
    try:
        http.run(sockets=[sock])
    finally:
        gc.unfreeze()
    return 1 if server.worker.failure not in (None, SHUTDOWN_MESSAGE) else 0


SHUTDOWN_MESSAGE = "the server is shutting down (--shutdown-timeout)"
SHUTDOWN_GRACE = 5.0  # seconds uvicorn waits after that for the answers to go out, then cancels


def _end_requests_after(http, server, timeout: float) -> None:
    """Once the server is told to stop (SIGTERM, Ctrl-C: uvicorn stops accepting connections),
    its running requests get ``timeout`` seconds; those still running then end with an error
    (a streamed one with an error event and ``[DONE]``), so the process ends in bounded time."""
    while not http.should_exit:
        time.sleep(0.2)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = server.worker.stats()
        if not stats["active"] and not stats["waiting"]:
            return
        time.sleep(0.2)
    server.worker.fail_all(SHUTDOWN_MESSAGE, status=503, code="server_shutting_down")


def _graphs(counts) -> str:
    """' (N graphs: L loaded whole from the compile cache, T traced again, C compiled by Inductor)' for
    a warm-up part that made graphs (``counts``: see ``compile_counts``), else ''."""
    if not counts or not counts["graphs"]:
        return ""
    return (f" ({counts['graphs']} graphs: {counts['loaded']} loaded whole from the compile cache, "
            f"{counts['traced']} traced again, {counts['compiled']} compiled by Inductor)")
