"""Round times that follow the device's speed from call to call (:class:`Drift`), for
:class:`~longspec.decoding.controller.Controller`: a candidate's round time is the median of its
last rounds, kept across calls, so a time measured while the device or the host ran slow (or at a
much shorter context) would stay with a candidate that does not run again, and keep it out of
every later call (docs/benchmarks.md, "A slow stretch kept its times for later calls"). Plain
Python over the controller's records: ``times`` {label: round times, ms}, ``called`` {label: the
call of its last round}."""
from __future__ import annotations

import statistics
from typing import Optional

DRIFT = 1.25  # a settled candidate's time this much off its earlier one: every earlier time follows


def median(times: list) -> float:
    ordered = sorted(times)
    return ordered[len(ordered) // 2]


class Drift:
    """Per call: :meth:`begin` notes every settled candidate's time; the call's first of them to
    settle again (:meth:`settled`, after its first ``rounds`` rounds) that runs more than DRIFT
    off it scales the times from before the call of every candidate last timed in the same call
    as it was, or earlier (its own, the others': one device, one context) by as much, for the
    rest of the call (a candidate timed in a later call says nothing of the old times, and keeps
    its own). :meth:`end` confirms the drift on the rounds after those that found it (of every
    candidate with a time from before the call that ran ``rounds`` of them: the median of their
    medians over those times, the middle two's mean, so a time dropped as stale does not confirm
    alone what the drifted candidate's own rounds deny; fewer: unconfirmed) and takes a slower
    call back to the usual speed (its rounds divided by that factor, the old times as they were:
    the slow stretches seen were one call long, and slowed candidates unequally, plain rounds
    1.5x and the chain 1.3x: kept, such times left a call running the chain 7% slower than plain
    rounds), keeps a faster one's speed (the old times scaled by it: a process's first rounds,
    the device still idling, measure slow), and undoes one it does not confirm (a transient in
    the first rounds). :attr:`shaky`: the labels whose times were so scaled, until a call
    without a drift measures every time they keep."""

    def __init__(self):
        self.before: dict = {}  # label -> its round time at the call's start (settled ones)
        self.carried: Optional[dict] = {}  # those not checked yet; None: one checked
        self.called_before: dict = {}  # called at the call's start
        self.followed: Optional[tuple] = None  # (label, the factor applied, its rounds, in_call then)
        self.shaky: set = set()

    def begin(self, times: dict, called: dict, settled: list, dropped: Optional[dict] = None) -> None:
        """A call begins; ``settled``: the labels whose times stand alone (enough rounds);
        ``dropped``: {label: its time} of those whose times were dropped (timed again in the
        call): a drift is confirmed on their rounds too, not found."""
        self.called_before = dict(called)
        self.carried = {name: median(times[name]) for name in settled}
        self.before, self.followed = {**(dropped or {}), **self.carried}, None

    def settled(self, name: str, rounds: int, times: dict, in_call: dict) -> None:
        """Candidate ``name`` has run its first ``rounds`` rounds of the call; ``in_call``: every
        label's rounds in this call."""
        if self.carried is None or name not in self.carried:
            return
        ms, self.carried = self.carried[name], None
        factor = self._factor(times[name][-rounds:], ms)
        self.followed = (name, factor, rounds, dict(in_call)) if factor != 1.0 else None
        self._rescale(factor, name, times, in_call)

    def end(self, times: dict, in_call: dict, window: int) -> None:
        """The call ends (``window``: the rounds a time is the median of): a slower call's times
        back to the usual speed, a faster one's kept, an unconfirmed drift undone (see the class
        docstring)."""
        final = 1.0
        if self.followed is not None:
            name, factor, rounds, then = self.followed
            ratios = []
            for label, ms in self.before.items():
                later = min(in_call.get(label, 0) - then.get(label, 0), window, len(times.get(label, ())))
                if later >= rounds and ms > 0:
                    ratios.append(median(times[label][-later:]) / ms)
            final = self._factor([statistics.median(ratios)], 1.0) if ratios else 1.0
            self._rescale(1.0 / factor if final > 1.0 else final / factor, name, times, in_call,
                          own=1.0 / final if final > 1.0 else 1.0)
            before, self.followed = self.called_before.get(name, 0), None
            if final > 1.0:
                self.shaky |= {label for label, kept in times.items() if kept and in_call.get(label)}
            elif final < 1.0:
                self.shaky |= {label for label, kept in times.items() if len(kept) > in_call.get(label, 0)
                               and self.called_before.get(label, 0) <= before}
        if final == 1.0:
            self.shaky -= {label for label, kept in times.items() if in_call.get(label, 0) >= len(kept)}

    @staticmethod
    def _factor(recent: list, ms: float) -> float:
        """The median of ``recent`` over ``ms``: 1 within DRIFT (or nothing to compare)."""
        now = median(recent) if recent else 0.0
        factor = now / ms if ms > 0 and now > 0 else 1.0
        return 1.0 if 1.0 / DRIFT <= factor <= DRIFT else factor

    def _rescale(self, factor: float, drifted: str, times: dict, in_call: dict, own: float = 1.0) -> None:
        """The times from before the call of every candidate last timed in ``drifted``'s last call
        or earlier, times ``factor``; the call's own rounds (``in_call``) times ``own``."""
        before = self.called_before.get(drifted, 0)
        for name, kept in times.items():
            old = len(kept) - min(in_call.get(name, 0), len(kept))
            if self.called_before.get(name, 0) <= before and factor != 1.0:
                kept[:old] = [t * factor for t in kept[:old]]
            if own != 1.0:
                kept[old:] = [t * own for t in kept[old:]]
