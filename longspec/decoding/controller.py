"""``--proposer auto`` while it generates: an online choice, after every round, among the rounds
one engine can run (plain rounds, prompt lookup's chain alone, the hybrid's trees), by measured
tokens per second. A policy above the engine: it chooses, the engine runs what it is told
(:meth:`~longspec.engine.engine.Engine.use_tree`).

* **Round times** are measured on every round whose time is its own (the engine's round:
  drafting, verifying, the host's reading of it; not the controller's own work, a switch's or a
  launch from idle: :func:`~longspec.decoding.rounds.run_rounds`) and kept across calls per
  candidate and kind of round (:func:`round_kind`: greedy, sampled, truncated): the median of its
  last :data:`TIME_WINDOW` rounds (not the text's doing; a median is not moved by a hiccup of the
  host, which an average would carry for good into a candidate that then never runs again),
  following the device's speed from call to call (:mod:`~longspec.decoding.drift`). Until a
  candidate has run, the cost model's prediction stands in (:mod:`~longspec.decoding.auto`),
  scaled by how the measured rounds of the others compare with their predictions (on a GPU the
  cost model times uncompiled steps; on a CPU it times the engine's own steps, and the measured
  rounds' extra time, their host work, is added instead).
* **Tokens per round** are estimated per call: the cost model's prediction for this prompt,
  corrected by what earlier calls measured against their predictions at the same sampling
  settings (the cost model knows greedy acceptance only: a sampled call's draft and lookup hit
  less; a candidate none measured yet takes the pooled correction of its kind's: the draft's
  trees, or the lookup's chains), worth :data:`~longspec.decoding.candidates.PRIOR_ROUNDS` rounds, then
  the call's own rounds.
  Within a call, no candidate expects more of the cost model than its own rounds made of it
  (once it ran a few), or, untried, than the ones that ran made of theirs (a text the draft and
  the lookup hit less than predicted lowers every prediction: one failed tree is not followed by
  its sibling; and one candidate's good rounds do not lift another's back: no flapping).
* **The choice**: the candidate with the most expected tokens per second, where it beats the one
  running by :data:`SWITCH_MARGIN` after :data:`DWELL` rounds (each switch costs the host work
  of taking the rows in, which a near tie does not pay back; at temperature 1 the draft's tree,
  the lookup's chain and plain rounds often lie within a few percent of each other, and a
  smaller margin had them take turns on the noise of their estimates); plain rounds take over
  at :data:`RETREAT_MARGIN` (a call must not be slower than plain decoding: at 1.1 a tree 8%
  slower than plain rounds kept running for a whole call). Plain decoding (one token a round)
  is always a candidate, so rounds that do not pay lose their place within a few rounds; its
  time is measured first in a process, again after long (:data:`RETIME_AFTER`) and after a
  drift, where the choice hangs on it (:data:`RETIME_MARGIN`).
* **Probes** (:mod:`~longspec.decoding.probes`): a candidate whose correction may be a
  prompt's accident, or a kind of candidate never timed, runs a few rounds, and its own rounds
  decide."""
from __future__ import annotations

from typing import Optional

from ..spec.drafting import takes_lookup
from ..spec.tree import TreeSpec
from .candidates import CLEAR_MARGIN, RETREAT_MARGIN, SETTLED_ROUNDS, Candidate, label, round_kind
from .corrections import MAX_CORRECTION, Corrections, kind_of
from .drift import Drift, median
from .probes import Probing

TIME_WINDOW = 9  # a candidate's round time: the median of its last rounds this many
SWITCH_MARGIN = 1.1  # a candidate takes over when predicted this much faster (from plain rounds at a call's start too)
DWELL = 4  # rounds a candidate runs before another may take over (each switch costs host work; see CLEAR_MARGIN)
RETIME_AFTER = 64  # plain rounds last timed this many rounds ago are timed again at a call's start ...
RETIME_MARGIN = 1.25  # ... (first in a process; in a call after a drift) where the fastest is expected less than this much faster
RETRY_AFTER = 8  # rounds a candidate that gave way waits before a new prediction may bring it back


_CURRENT = object()  # observe's default: the round ran the current candidate


class Controller(Probing):
    """The choice of rounds for the calls of one engine (see the module docstring). Per call:
    :meth:`begin` with the cost model's predictions, then :meth:`observe` after every round (it
    returns the tree to run next), then :meth:`end`."""

    def __init__(self, store: Optional[str] = None, key: str = "", offset: bool = False):
        """``store``: a JSON file that keeps what the corrections learned (under ``key``: the
        model and draft) for the next process, e.g. the next ``longspec generate``. ``offset``:
        unmeasured candidates' times are the cost model's plus what measured rounds took beyond
        theirs (a CPU: the model times the engine's own eager steps, and a round adds host work
        alike to each), not scaled by it (a GPU: the model times uncompiled steps, the engine
        replays compiled graphs, faster in proportion)."""
        self.offset = offset
        # per kind of round (:func:`round_kind`): label -> its last round times (ms), across calls;
        # label -> self.rounds at its last round; label -> the call (self.calls) of its last round
        self.kinds_timed: dict = {}
        self.times, self.timed_at, self.called = self.records(None)
        self.rounds = self.calls = 0  # rounds observed, calls begun
        self.learned = Corrections(store, key)  # what earlier calls (and processes) measured
        self.candidates: dict = {}
        self.current: Optional[Candidate] = None
        self.planned: Optional[Candidate] = None
        self.dwell = 0  # rounds the current candidate has run since it took over
        self.probed = False  # a candidate was probed in this call
        self.time_probed: set = set()  # kinds of round at which a kind of candidate was probed for its time
        self.drifts: dict = {}  # kind of round -> its times' :class:`Drift`; ``drift``: the call's kind's
        self.drift = Drift()
        self.timed_in_call: dict = {}  # label -> its rounds in the current call that were timed
        self.sampling = None
        self.captured_kinds: set = set()  # kinds of round (greedy, truncating) whose every candidate is captured

    def records(self, kind) -> tuple:
        """(round times, last rounds, last calls) of the candidates at kind of round ``kind``."""
        return self.kinds_timed.setdefault(kind, ({}, {}, {}))

    def _settled(self, name: str) -> bool:
        """Whether candidate ``name``'s round time is measured over enough rounds to stand alone."""
        return len(self.times.get(name, ())) >= SETTLED_ROUNDS

    def round_ms(self, name: str) -> Optional[float]:
        """The measured round time of candidate ``name`` (the median of its last rounds), or None."""
        times = self.times.get(name)
        return median(times) if times else None

    def correction(self, name: str) -> float:
        """How much of the cost model's extra tokens per round candidate ``name`` made in earlier
        calls at this call's sampling settings (:meth:`Corrections.of`)."""
        return self.learned.of(name, self.sampling)

    def _expect(self, c: Candidate, predicted: float, most: float = MAX_CORRECTION) -> tuple:
        """(base, hoped): tokens per round expected of ``c`` from a prediction, its extra tokens
        corrected (the correction at most ``most``; hoped: a correction below 1 left out), no
        more than a round of its tree can emit (plain rounds: 1)."""
        if c.tree is None:
            return 1.0, 1.0
        extra, correction = max(predicted - 1.0, 0.0), min(self.correction(label(c.tree)), most)
        return (min(1.0 + extra * correction, 1.0 + c.tree.depth),
                min(1.0 + extra * max(correction, 1.0), 1.0 + c.tree.depth))

    def _prior(self, c: Candidate, predicted: float, most: float = MAX_CORRECTION) -> None:
        """``c`` expects :meth:`_expect` of a prediction: its prior, base and hoped tokens."""
        c.base, c.hoped = self._expect(c, predicted, most)
        c.prior = c.base

    def begin(self, predicted: dict, sampling=None) -> Optional[TreeSpec]:
        """``predicted``: {tree or None: (tokens per round, round ms)} from the cost model;
        ``sampling``: what acceptance depends on (e.g. (temperature, top_k, top_p)), the key of
        what earlier calls measured. Returns the tree of the call's first rounds."""
        if not predicted:
            raise ValueError("the controller starts from the cost model's predictions ({tree: (tokens, ms)}); "
                             "Generator(proposer='auto') gives them")
        self.sampling, self.candidates, self.probed, self.timed_in_call = sampling, {}, False, {}
        kind = round_kind(sampling)
        self.times, self.timed_at, self.called = self.records(kind)
        self.drift, self.calls = self.drifts.setdefault(kind, Drift()), self.calls + 1
        for tree, (tokens, ms) in predicted.items():
            c = Candidate(tree, ms, 1.0, predicted=1.0 if tree is None else tokens, predicted_ms=ms)
            self._prior(c, c.predicted)
            self.candidates[label(tree)] = c
        self._calibrate()
        self.current, self.dwell = self._best(), 0
        self.planned = self.current  # (the candidate predicted fastest, whatever runs first)
        plain, dropped = self.candidates.get("plain"), {}
        if plain is not None and self.current.rate < SWITCH_MARGIN * plain.rate:
            self.current = plain
        if plain is not None and self.planned.rate < RETIME_MARGIN * plain.rate and (
                not self._settled("plain") or self.rounds - self.timed_at.get("plain", self.rounds) > RETIME_AFTER):
            # plain rounds first where the choice hangs on their time: until it is measured (once a
            # process: every candidate is weighed against it, and the cost model's time for them
            # scales least like the others': docs/benchmarks.md, "Generation on a CPU"), and again
            # when old (another context; a process's first rounds, on a device still idling, measure
            # slow), its old times dropped (a drift is not found on them, only confirmed). One
            # predicted clearly faster runs at once (a new process per `longspec generate`: on a
            # CPU, a real share of a call)
            if self._settled("plain"):
                dropped, self.times["plain"] = {"plain": median(self.times["plain"])}, []
            self.current = plain
        self.drift.begin(self.times, self.called, [name for name in self.candidates if self._settled(name)], dropped)
        return self.current.tree

    def gain(self) -> Optional[float]:
        """The expected speed of the candidate :meth:`begin` found fastest over plain rounds'
        (None: no plain candidate)."""
        plain = self.candidates.get("plain")
        return None if plain is None else self.planned.rate / plain.rate

    def wants_predictions(self) -> bool:
        """Whether :meth:`repredict` may change a candidate: one that has not run in this call,
        or one that ran, is not running and has not been re-predicted in it."""
        return any(c.tree is not None and (c.rounds == 0 or c is not self.current and not c.retried)
                   for c in self.candidates.values())

    def repredict(self, tokens: dict) -> None:
        """New predictions of tokens per round ({tree: tokens}; e.g. from the lookup's hit rate on
        the text generated so far) for candidates that have not run in this call, and once a call
        for one that gave way (:data:`RETRY_AFTER` rounds ago at least) where the new prediction's
        extra tokens exceed what its rounds made by CLEAR_MARGIN and it would take over; a tree
        expects what its rounds made plus the rise of its prediction over the one it ran with (a
        tree's prediction is mostly the draft's acceptance, the same as when it failed, e.g. at
        temperature 1 on an answer the draft does not predict; what rose is the lookup's part; a
        chain's prediction is the lookup's, from the repeats of the text since): the text
        generated since repeats more than when it ran (a chat answer begins in prose and quotes
        the code later), and its rounds then say less of the next ones than the text does. A
        correction below 1 applies to them too (sampling's lower acceptance, a draft's optimism),
        one above 1 not: they read the generated text, which is what the prompt's predictions
        missed."""
        for tree, value in tokens.items():
            c = self.candidates.get(label(tree))
            if c is None or tree is None:
                continue
            is_tree = tree.kind != "chain"
            if c.rounds == 0:
                if not (c.retried and is_tree):  # (a retried tree keeps what it made plus the rise)
                    self._prior(c, value, most=1.0)
            elif c is not self.current and not c.retried and self.rounds - self.timed_at.get(label(tree), 0) >= RETRY_AFTER:
                base, _ = self._expect(c, value, most=1.0)
                made = c.tokens / c.rounds
                if is_tree:  # (its rounds measured the draft on this text: only the rise is new)
                    base = min(base, made + base - c.base)
                if base - 1.0 > CLEAR_MARGIN * max(made - 1.0, 0.0) and \
                        base / max(c.ms, 1e-6) > SWITCH_MARGIN * self.current.rate:
                    self._prior(c, value, most=1.0)
                    if is_tree:
                        c.base = c.prior = c.hoped = base
                    c.retried, c.earlier = True, (c.earlier[0] + c.tokens, c.earlier[1] + c.rounds)
                    c.tokens, c.rounds = 0.0, 0
        self._temper()

    def observe(self, tokens: float, seconds: Optional[float], tree=_CURRENT) -> Optional[TreeSpec]:
        """A round of ``tree`` (default: the current candidate's) emitted ``tokens`` per row in
        ``seconds`` (None: a time that is not the round's own, e.g. a GPU's round that waited for
        a switch: :func:`~longspec.decoding.rounds.run_rounds`; its tokens count): returns the
        tree for the next rounds (the current one, or the candidate that now looks faster). A caller may observe a round late (a GPU's round runs while the
        controller weighs the one before): ``tree`` says which candidate ran it. A plain round
        (None) observed while the current candidate drafts (one in flight when it took over, or
        on a CPU a lookup chain's round that found no match and drafted nothing: a decode step,
        :data:`~longspec.spec.prompt_lookup.DECODE_BELOW`) times plain rounds, and the choice
        waits for the current candidate's own rounds (a chain's say what it makes where it
        drafts; where it does not, it costs what plain rounds do)."""
        decoded = tree is None and self.current.tree is not None
        if decoded and "plain" not in self.candidates:
            return self.current.tree  # (nothing to time it for)
        name = label(self.current.tree if tree is _CURRENT else tree)
        c = self.candidates.get(name, self.current)
        name = label(c.tree)
        times = self.times.setdefault(name, [])
        if seconds is not None:
            times.append(1e3 * seconds)
            del times[:-TIME_WINDOW]
            self.timed_in_call[name] = self.timed_in_call.get(name, 0) + 1
        self.rounds += 1
        self.timed_at[name], self.called[name] = self.rounds, self.calls
        c.tokens += tokens
        c.rounds += 1
        self.dwell += c is self.current
        if seconds is not None and self.timed_in_call[name] == SETTLED_ROUNDS:
            self.drift.settled(name, SETTLED_ROUNDS, self.times, self._in_call())
        self._calibrate()
        if c.tree is not None:
            self._temper()
        if decoded:
            return self._after_plain_round()
        if self._retime_plain(c) or self.current.tree is None and len(self.times.get("plain", ())) < SETTLED_ROUNDS:
            return None  # (plain rounds being timed)
        best = self._best()
        probe = self._probe(best)
        if probe is not None:
            self.current, self.dwell, self.probed = probe, 0, True
            return probe.tree
        probed = c.tree is None and seconds is not None and len(times) == SETTLED_ROUNDS  # (once a process: just timed)
        margin = RETREAT_MARGIN if best.tree is None else SWITCH_MARGIN
        if best is not c and (best.rate > CLEAR_MARGIN * c.rate or best.rate > margin * c.rate
                              and (self.dwell >= DWELL or probed)):
            self.current, self.dwell = best, 0
        return self.current.tree

    def _after_plain_round(self) -> Optional[TreeSpec]:
        """The tree for the next rounds after a plain round observed while the current candidate
        drafts (see :meth:`observe`): another speculative candidate may take over as after the
        current one's own round (its dwell counts its own rounds only: a GPU's late round ran
        before it took over); plain rounds do not (the current candidate's own rounds decide that:
        a CPU's lookup chain that drafted nothing cost what a plain round does)."""
        best = max((c for c in self.candidates.values() if c.tree is not None), key=lambda c: c.rate)
        if best is not self.current and (best.rate > CLEAR_MARGIN * self.current.rate or
                                         best.rate > SWITCH_MARGIN * self.current.rate and self.dwell >= DWELL):
            self.current, self.dwell = best, 0
        return self.current.tree

    def _retime_plain(self, ran: Candidate) -> bool:
        """Plain rounds timed again now (old times dropped) where a drift moved the times carried
        into this call, plain rounds have not run in it, and ``ran``, running and settled, is
        expected within RETIME_MARGIN of them: a drift's one factor does not fit every candidate
        (after a stretch that slowed plain rounds 1.5x and the chain 1.3x, the chain ran a whole
        call 7% slower than plain rounds)."""
        plain = self.candidates.get("plain")
        if plain is None or plain.rounds or ran is not self.current or ran is plain or ran.rounds < SETTLED_ROUNDS \
                or self.drift.followed is None and "plain" not in self.drift.shaky or ran.rate >= RETIME_MARGIN * plain.rate:
            return False
        self.times["plain"], self.current, self.dwell = [], plain, 0
        return True

    def vs_plain(self, tokens_per_ms: float) -> Optional[float]:
        """``tokens_per_ms`` against plain rounds' rate, where their time is measured (else None)."""
        return tokens_per_ms * self.round_ms("plain") if self._settled("plain") else None

    def end(self) -> None:
        """Folds this call's measured tokens per round, against the predictions, into the
        correction of later calls at the same sampling settings; a drift followed in the call is
        confirmed or undone on its later rounds (:meth:`Drift.end`)."""
        self.drift.end(self.times, self._in_call(), TIME_WINDOW)
        for name, c in self.candidates.items():
            tokens, rounds = c.tokens + c.earlier[0], c.rounds + c.earlier[1]
            if rounds and c.tree is not None:
                self.learned.fold(name, self.sampling, tokens - rounds, rounds * max(c.predicted - 1.0, 0.0))
        self.learned.keep()

    def summary(self) -> str:
        """What each candidate measured in this call (for a call's stats)."""
        return "; ".join(f"{name}: {c.rounds + c.earlier[1]} rounds, {c.tokens_per_round:.2f} tokens in {c.ms:.2f} ms"
                         for name, c in self.candidates.items())

    def _calibrate(self) -> None:
        """Candidates never measured on this engine: their predicted time, scaled by the measured
        over the predicted time of those of their kind that were (plain rounds, the draft's trees,
        the lookup's chains: the cost model scales alike within a kind, not across; none of its
        kind: those of any kind); candidates measured in fewer than
        :data:`SETTLED_ROUNDS` rounds: no slower than that (one slow round must not keep a
        candidate out for good: nothing would measure it again). Plain rounds timed before a
        settled speculative round cost no more than it: theirs is the same step verifying one
        token, without a draft (a process's first plain rounds, the device still idling after
        the captures, measured slower than the chain's, which then ran every later call where
        it missed, plain rounds never timed again); a later time of theirs stands."""
        measured = {name: self.round_ms(name) for name in self.candidates}
        settled = [name for name in self.candidates if self._settled(name)]
        if measured.get("plain") is not None:  # (a plain round does less than any other round)
            at = self.timed_at.get("plain", 0)
            measured["plain"] = min([measured["plain"]] + [measured[n] for n in settled
                                                           if n != "plain" and self.timed_at.get(n, 0) > at])
        gaps = {kind: self._gap([n for n in settled if kind_of(n) == kind] or settled, measured)
                for kind in set(map(kind_of, self.candidates))}
        for name, c in self.candidates.items():
            gap = gaps[kind_of(name)]
            estimate = max(c.predicted_ms + gap, 1e-3) if self.offset else gap * c.predicted_ms
            if measured[name] is None:
                c.ms = estimate
            elif not self._settled(name):
                c.ms = min(measured[name], estimate)
            else:
                c.ms = measured[name]

    def _in_call(self) -> dict:
        """label -> the rounds it ran in this call with a time (:meth:`observe`): its last times'."""
        return dict(self.timed_in_call)

    def _best(self) -> Candidate:
        return max(self.candidates.values(), key=lambda c: c.rate)

    def _temper(self) -> None:
        """No candidate expects a larger share of its predicted extra tokens than this call gave:
        one that ran 2 x SETTLED_ROUNDS rounds, than its own rounds made (its prior only ever
        lowered, so it converges on what it measures, and no other candidate's rounds move it; a
        call's first rounds say less: on a CPU a tree measured 3, 1 and 3 tokens where the cost
        model said 6.3, then made 6-7 a round); one that has not run, than those that ran made,
        pooled (once they ran SETTLED_ROUNDS): for a tree every candidate that ran (its
        prediction reads the lookup's hits too), for a chain the chains (a tree's shortfall says
        the draft misses this text, not that the lookup does: on a CPU one held the lookup's
        chain at half of its text's prediction for a whole call). But an untried chain expects no
        more tokens a round than a hybrid tree at least as deep made, run in the last 2 x
        RETRY_AFTER rounds (SETTLED_ROUNDS rounds at least): the tree holds the lookup's chain as
        one of its paths (:func:`~longspec.spec.drafting.takes_lookup`), so on that text it accepts
        at least as much (at T=1 trees that made 1.0 tokens a round were followed by 5-13 rounds of
        the chain)."""
        ran = [c for c in self.candidates.values() if c.rounds and c.tree is not None]
        for c in ran:
            if c.rounds >= 2 * SETTLED_ROUNDS and c.base > 1.0:
                c.prior = 1.0 + (c.base - 1.0) * min(max((c.tokens / c.rounds - 1.0) / (c.base - 1.0), 0.0), 1.0)
        shares = {kind: self._share([c for c in ran if kind == "tree" or c.tree.kind == "chain"])
                  for kind in ("tree", "chain")}
        made = [(c.tree.depth, c.tokens / c.rounds) for c in ran if takes_lookup(c.tree) and c.rounds >= SETTLED_ROUNDS
                and self.rounds - self.timed_at.get(label(c.tree), 0) <= 2 * RETRY_AFTER]
        for c in self.candidates.values():  # (a retried one: its text's prediction)
            share = None if c.rounds or c.tree is None or c.retried else shares[kind_of(label(c.tree))]
            if share is not None:
                c.prior = 1.0 + (c.base - 1.0) * share
            if c.tree is not None and c.tree.kind == "chain" and not c.rounds and not c.retried:
                most = max((tokens for depth, tokens in made if depth >= c.tree.depth), default=None)
                if most is not None:
                    c.prior, c.hoped = min(c.prior, most), min(c.hoped, most)

    @staticmethod
    def _share(ran: list) -> Optional[float]:
        """The share of their predicted extra tokens candidates ``ran`` made in this call (None:
        fewer than SETTLED_ROUNDS rounds, or none predicted)."""
        hoped = sum(c.rounds * (c.base - 1.0) for c in ran)
        if sum(c.rounds for c in ran) < SETTLED_ROUNDS or hoped <= 0.0:
            return None
        return min(max(sum(c.tokens - c.rounds for c in ran) / hoped, 0.0), 1.0)

    def _gap(self, names: list, measured: dict) -> float:
        """How candidates ``names``' ``measured`` round times compare with their predictions: the
        median ratio (with ``offset``, the median of measured less predicted; none: no change)."""
        gaps = [measured[n] - self.candidates[n].predicted_ms if self.offset else
                measured[n] / self.candidates[n].predicted_ms
                for n in names if self.candidates[n].predicted_ms > 0]
        return median(gaps) if gaps else 0.0 if self.offset else 1.0
