"""What a command says on stderr while it works: one-line status messages, and a heartbeat for
steps that report no progress of their own, so that no step sits silent for more than a few
seconds."""
from __future__ import annotations

import sys
import threading
import time

BEAT_S = 2.0  # a heartbeat's line comes this often



def status(message: str) -> None:
    """One line on stderr saying what a step that may take more than a moment is doing."""
    print(f"[longspec: {message}]", file=sys.stderr, flush=True)


class Heartbeat:
    """While its block runs, a status line every ``every`` seconds: ``label()`` (what runs now,
    asked each time) and the seconds so far, until ``until()`` (if given) says the step is over.
    For steps that report no progress of their own (a conversion's stages inside transformers, a
    server's warm-up compiling and capturing) or report it seldom (a CPU's prefill, by pieces)."""

    def __init__(self, label, every: float = None, until=None):
        self.label, self.every, self.until = label, BEAT_S if every is None else every, until
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="longspec-status", daemon=True)

    def _beat(self) -> None:
        start = time.monotonic()
        while not self.stop.wait(self.every):
            if self.until is not None and self.until():
                return
            status(f"{self.label()}: {time.monotonic() - start:.0f} s so far")

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
