"""Probes of :class:`~longspec.decoding.controller.Controller`: candidates run a few rounds so
that their own rounds decide, where the controller's estimate of them may be wrong.

* A correction learned from fewer than :data:`~longspec.decoding.corrections.PROBE_CALLS` calls
  may be a prompt's accident (a lookup hits little on one prompt, much on the next): a
  candidate whose rounds were measured (or calibrated by those of its kind) to cost little more
  than plain ones (:data:`PROBE_COST`) and whose uncorrected prediction is clearly the fastest
  runs a few rounds once in such a call (:meth:`Probing._probe`).
* A kind never timed (on a GPU the draft's trees, on a CPU the lookup's chains) is probed alike
  once a process for its time (:meth:`Probing._time_probe`)."""
from __future__ import annotations

from typing import Optional

from .candidates import CLEAR_MARGIN, RETREAT_MARGIN, SETTLED_ROUNDS, Candidate, round_kind
from .corrections import kind_of

# a candidate whose correction is uncertain (corrections.PROBE_CALLS) may be probed where its round costs at
# most this many plain rounds (a GPU's small trees at temperature 1)
PROBE_COST = 1.5
# a kind of candidate never timed at a kind of round (on a GPU the draft's trees, on a CPU the lookup's chains) runs a
# few rounds once a process where it would be the fastest at this share of its estimated time (a GPU's cost model
# drafts uncompiled, so trees run well under their scaled estimate; a CPU's times a short prompt's steps at its first
# measured context: docs/benchmarks.md, "That code in workloads" and "Chains never timed on a CPU")
UNTIMED_SHARE = 0.8


class Probing:
    """The controller's probes (see the module docstring). Reads the controller's candidates,
    corrections (``learned``), sampling settings, calls, current candidate, ``offset`` and
    measured times; keeps ``probed`` (this call) and ``time_probed`` (this process)."""

    def _probe(self, best: Candidate) -> Optional[Candidate]:
        """A candidate to probe now (see the module docstring), or None: once a call, untried in
        it, its correction uncertain, its rounds cheap as measured at this kind of round
        (:meth:`_known_ms`: a probe's cost must be bounded by what it costs, and a prediction's time
        alone is the least reliable in a new process), its uncorrected prediction faster than
        ``best`` (the candidate expected fastest) by CLEAR_MARGIN; of several, the one whose
        uncorrected prediction is fastest."""
        plain = self.candidates.get("plain")
        if self.probed or plain is None or not self._settled("plain"):
            return None
        probes = [c for name, c in self.candidates.items()
                  if not (c.rounds or c.retried or c.tree is None or self.learned.certain(name, self.sampling))
                  and (ms := self._known_ms(name)) is not None and ms <= PROBE_COST * plain.ms
                  and c.hoped / c.ms >= CLEAR_MARGIN * best.rate]
        return max(probes, key=lambda c: c.hoped / c.ms, default=None) or self._time_probe(best)

    def _time_probe(self, best: Candidate) -> Optional[Candidate]:
        """A candidate to run a few rounds for its time, or None: on a GPU one of the draft's
        trees, from a process's second call (its first rounds measure slow: the device idles
        after the captures); on a CPU (``offset``) a lookup chain (its rounds cost 1.5x plain
        ones there, the trees' 3x). Once a process per kind of round, where no candidate of that
        kind has a settled time at it, untried in the call, once the running candidate ran
        SETTLED_ROUNDS rounds of it (a speculative one's rounds temper the others'
        expectations), where at UNTIMED_SHARE of its time it would beat ``best`` (the fastest
        expected) by RETREAT_MARGIN; of several, the one expected fastest. Like :meth:`_probe`'s
        (which calls it: plain rounds timed, one probe a call) its own rounds then decide. Its
        time is the cost model's scaled by (on a CPU: offset by) other kinds' rounds, which
        misjudges a kind never timed: at temperature 1 on a GPU trees expected just below plain
        rounds never ran in a process where they paid, and on a CPU continuing a short prompt
        the chain, expected just under the switch margin, never ran where prompt lookup alone
        beat plain decoding (docs/benchmarks.md)."""
        kind, round_kind_now = "chain" if self.offset else "tree", round_kind(self.sampling)
        if not self.offset and self.calls < 2 or self.current.rounds < SETTLED_ROUNDS \
                or round_kind_now in self.time_probed \
                or any(kind_of(name) == kind and self._settled(name) for name in self.candidates):
            return None
        probes = [c for name, c in self.candidates.items() if kind_of(name) == kind and not (c.rounds or c.retried)
                  and c.rate >= UNTIMED_SHARE * RETREAT_MARGIN * best.rate]
        probe = max(probes, key=lambda c: c.rate, default=None)
        if probe is not None:
            self.time_probed.add(round_kind_now)
        return probe

    def _known_ms(self, name: str) -> Optional[float]:
        """Candidate ``name``'s round time where a measurement at this kind of round vouches for
        it: its own, or its calibrated prediction where a candidate of its kind (another of the
        draft's trees, another lookup chain) has settled times to calibrate it by (the cost model
        scales alike within a kind, not across: a CPU's tree rounds cost twice what plain rounds'
        calibration made of them); else None."""
        measured = self.round_ms(name)
        if measured is not None:
            return measured
        if any(other != name and kind_of(other) == kind_of(name) and self._settled(other) for other in self.candidates):
            return self.candidates[name].ms  # (:meth:`_calibrate` scaled it by them)
        return None
