"""A ``longspec serve`` process for the server tests."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import openai


def copy_tokenizer(source, dest) -> None:
    """Copies the tokenizer files of checkpoint folder ``source`` (a Path) into ``dest``."""
    import shutil

    for name in os.listdir(source):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(source / name, dest / name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``longspec serve`` process on a free port (``env``: added to the environment)."""

    def __init__(self, *args, env=None, key=None):
        self.port, self.key = free_port(), key
        self.proc = subprocess.Popen([sys.executable, "-m", "longspec.cli", "serve", "--port", str(self.port),
                                      "--threads", "1", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        raise RuntimeError("server did not start")

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10, headers=self.headers).json()

    def post(self, body, path="/v1/completions", timeout=120, **kw):
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(self.url + path, content=raw, timeout=timeout,
                          headers={"content-type": "application/json", **self.headers, **kw.pop("headers", {})}, **kw)

    def client(self, cls=None):
        return (cls or openai.OpenAI)(base_url=self.url + "/v1", api_key=self.key or "none", max_retries=0,
                                      timeout=300)

    def descendants(self) -> list:
        """Pids of the server's live child processes and theirs (Linux /proc)."""
        parents = {}
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if entry.isdigit() and fields[0] != "Z":
                parents.setdefault(int(fields[1]), []).append(int(entry))
        out, todo = [], [self.proc.pid]
        while todo:
            kids = parents.get(todo.pop(), [])
            out += kids
            todo += kids
        return out

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
