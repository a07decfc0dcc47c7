"""Round times that follow the device's speed from call to call (:class:`Drift`), for
:class:`~longspec.decoding.controller.Controller`: a candidate's round time is the median of its
last rounds, kept across calls, so a time measured while the device or the host ran slow (or at a
much shorter context) would stay with a candidate that does not run again, and keep it out of
every later call (docs/benchmarks.md, "A slow stretch kept its times for later calls"). Plain
Python over the controller's records: ``times`` {label: round times, ms}, ``timed_at`` {label:
the controller's round count at its last round}."""
from __future__ import annotations

from typing import Optional

DRIFT = 1.25  # a settled candidate's time this much off its earlier one: every earlier time follows


def median(times: list) -> float:
    ordered = sorted(times)
    return ordered[len(ordered) // 2]


class Drift:
    """Per call: :meth:`begin` notes every settled candidate's time; the call's first of them
    to settle again (:meth:`settled`, after its first ``rounds`` rounds) that runs more than DRIFT
    off it scales the times from before the call of every candidate timed no later than it was
    (its own, the others': one device, one context) by as much; :meth:`end` corrects that to what
    its rounds in the whole call say (a transient in its first rounds alone is undone). A
    candidate timed since says nothing of the old times, and keeps its own."""

    def __init__(self):
        self.carried: Optional[dict] = {}  # label -> its round time at the call's start; None: checked
        self.timed_before: dict = {}  # timed_at at the call's start
        self.followed: Optional[tuple] = None  # (label, its time before, the factor applied)

    def begin(self, times: dict, timed_at: dict, settled: list) -> None:
        """A call begins; ``settled``: the labels whose times stand alone (enough rounds)."""
        self.timed_before = dict(timed_at)
        self.carried = {name: median(times[name]) for name in settled}
        self.followed = None

    def settled(self, name: str, rounds: int, times: dict, in_call: dict) -> None:
        """Candidate ``name`` has run its first ``rounds`` rounds of the call; ``in_call``: every
        label's rounds in this call."""
        if self.carried is None or name not in self.carried:
            return
        ms, self.carried = self.carried[name], None
        factor = self._factor(times[name][-rounds:], ms)
        self.followed = (name, ms, factor) if factor != 1.0 else None
        self._rescale(factor, name, times, in_call)

    def end(self, times: dict, in_call: dict, window: int) -> None:
        """The call ends: the factor applied becomes what the drifted candidate's last ``window``
        rounds of the call say."""
        if self.followed is not None:
            name, ms, factor = self.followed
            self._rescale(self._factor(times[name][-min(in_call[name], window):], ms) / factor, name, times, in_call)
            self.followed = None

    @staticmethod
    def _factor(recent: list, ms: float) -> float:
        """The median of ``recent`` over ``ms``: 1 within DRIFT (or nothing to compare)."""
        now = median(recent) if recent else 0.0
        factor = now / ms if ms > 0 and now > 0 else 1.0
        return 1.0 if 1.0 / DRIFT <= factor <= DRIFT else factor

    def _rescale(self, factor: float, drifted: str, times: dict, in_call: dict) -> None:
        """The times from before the call of every candidate timed no later than ``drifted`` was,
        times ``factor``; the call's own rounds (``in_call``) stay as measured."""
        if factor == 1.0:
            return
        before = self.timed_before.get(drifted, 0)
        for name, kept in times.items():
            if self.timed_before.get(name, 0) <= before:
                old = len(kept) - min(in_call.get(name, 0), len(kept))
                kept[:old] = [t * factor for t in kept[:old]]
