"""A call's rounds over an :class:`~longspec.engine.engine.Engine`, steered by a controller:
each round's measurements go to it, and the engine runs the tree it names next; on a GPU the
next round is launched before this one's tokens are read."""
from __future__ import annotations

import time
from collections import deque
from typing import Optional

from ..engine.engine import Engine
from ..spec.tree import TreeSpec

_KEEP = object()  # run_rounds: no new choice of tree this round


def tree_text(tree: Optional[TreeSpec]) -> Optional[str]:
    """A tree's text in a call's stats (None: plain rounds)."""
    return None if tree is None else str(tree)


def run_rounds(engine: Engine, seqs: list, streamer, controller, trees: list, repredict=None,
               launch_ahead: Optional[bool] = None) -> tuple:
    """Rounds until every row is done; with a ``controller`` (see
    :class:`~longspec.decoding.controller.Controller`), every round's measurements (its tree, None
    for a round that drafted nothing, tokens per row, wall time or None) go to it, and the engine runs the tree it names next;
    ``repredict(tokens, n_prompt)``: new predictions of tokens per round from the text so far,
    given to it at 16, 32, 64, ... generated tokens (on a CPU, whose rounds take tens of
    milliseconds, every 8). On a GPU the next round is launched before this one's tokens are
    read (:meth:`Engine.launch` ahead, where every row has room for both): the device runs
    rounds back to back, and the host's work on a round (its tokens, the controller's
    weighing, a re-prediction) costs no time while it is shorter than a round; a choice of
    tree takes effect a round later, after the round in flight, and, unless the proposer takes
    the rows in for it behind a tree's round (it reads their text, to which that round adds
    tokens the host does not know yet: :meth:`Engine.waits_for_rounds`), is made while that
    round runs: the device does not wait for the switch either (``launch_ahead``: whether
    rounds are launched ahead; None: on a GPU). ``trees`` gets (tokens generated when it took
    over, its text) for each switch. A round launched ahead measures the device's time of a
    round; one launched with none in flight (a call's first, the rounds after a switch that
    waited for the rounds in flight, a call's last), or one in flight while the host switched or
    re-predicted, also measures the host's work or a launch from idle: its time goes to the
    controller as None (its tokens count), so a candidate's time is its rounds' own (docs/benchmarks.md, "Round times
    without the host's extra work"). Returns the number of rounds and the seconds they took (not
    the loop's other work: switches, and on a CPU the controller's)."""
    rounds, stepping, seq = 0, 0.0, seqs[0]
    on_cpu = engine.target.device.type == "cpu"
    check, chosen = 8 if on_cpu else 16, _KEEP
    ahead = not on_cpu if launch_ahead is None else launch_ahead
    # [tree, when, whether its time is a round's alone] of the rounds in flight; when the last one's tokens came
    launched, last, extra_work = deque(), 0.0, False
    switched = None  # [tree text, rounds of the old tree in flight] of a switch made while they ran

    def finish() -> None:
        nonlocal rounds, stepping, last, check, chosen, switched
        tree, start, timed = launched.popleft()
        tokens = engine.finish(streamer)
        now = time.perf_counter()
        if switched is not None:
            switched[1] -= 1
            if not switched[1]:  # (the new tree's first round is next, where a row is left for it)
                if engine.has_active:
                    trees.append((len(seq.tokens), switched[0]))
                switched = None
        seconds, last = now - max(start, last), now
        rounds, stepping = rounds + 1, stepping + seconds
        if controller is None or tokens is None or not engine.has_active:
            return
        if repredict is not None and len(seq.tokens) >= check:
            check = check + 8 if on_cpu else 2 * check
            if controller.wants_predictions():
                controller.repredict(repredict(seq.prompt + seq.tokens, len(seq.prompt)))
                untimed()
        # (a round that drafted nothing, a CPU's lookup chain without a match, is a plain round)
        chosen = controller.observe(tokens, seconds if timed else None, None if engine.decoded else tree)

    def untimed() -> None:
        """The host's extra work (a switch, a re-prediction) falls in the times of the rounds in
        flight, and a switch's device work (the rows taken in) in the next round's."""
        nonlocal extra_work
        for entry in launched:
            entry[2] = False
        extra_work = True

    try:
        while engine.has_active:
            while engine.has_active and (not launched or ahead and len(launched) < 2 and engine.can_launch_ahead()):
                tree, start = engine.tree_of(engine.bucket()), time.perf_counter()
                engine.launch(ahead=bool(launched))
                launched.append([tree, start, not ahead or bool(launched) and not extra_work])
                extra_work = False
            finish()
            if chosen is not _KEEP and engine.has_active and chosen != engine.tree_of(engine.bucket()):
                while launched and engine.waits_for_rounds(chosen):
                    finish()  # (the round in flight: finished, and weighed, first)
                if engine.has_active and chosen != engine.tree_of(engine.bucket()):
                    engine.use_tree(chosen)
                    untimed()
                    if launched:
                        switched = [tree_text(chosen), len(launched)]
                    else:
                        trees.append((len(seq.tokens), tree_text(chosen)))
            chosen = _KEEP
    finally:  # (an error or Ctrl-C, even while waiting for a round, leaves none running in the shared engine)
        while engine.in_flight:
            engine.finish()
    return rounds, stepping

