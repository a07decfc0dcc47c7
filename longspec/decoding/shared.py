"""What a process keeps for one target model while the model lives: :class:`Engines`, the
long-lived engines of its :class:`~longspec.decoding.generator.Generator` calls, the drafts and
proposers they share, and ``auto``'s controller of each engine."""
from __future__ import annotations

import weakref
from typing import Optional

from ..convert import home_dir
from ..engine.engine import Engine
from ..models.target import TargetModel
from ..spec.proposers import build_proposer, resolve_draft
from .step_costs import corrections_key
from .controller import Controller

CORRECTIONS_FILE = "corrections.json"  # in the longspec home: what auto's controllers learned (see Controller)


class Engines:
    """The one owner of a target's engines in this process (held by the target:
    :meth:`of`, so they live as long as it does): ``engines`` {key: Engine} (one per proposer,
    largest tree and settings: see ``Generator.engine``), the drafts loaded per folder, the
    proposers built per name and draft (one each, so that every Generator naming it shares its
    engine and graphs), and auto's controller of each engine (what it measured serves the
    engine's later calls)."""

    def __init__(self, target: TargetModel):
        self.target = weakref.ref(target)  # (the target holds this object)
        self.engines: dict = {}
        self._drafts: dict = {}  # folder (None: the shipped default) -> draft
        self._proposers: dict = {}  # (name, id(draft), window) -> (proposer, its draft, kept alive with it)
        self._controllers = weakref.WeakKeyDictionary()  # Engine -> Controller (not keeping a replaced engine alive)

    @staticmethod
    def of(target: TargetModel) -> "Engines":
        """The target's engines (made on first use)."""
        if target.engines is None:
            target.engines = Engines(target)
        return target.engines

    def draft(self, draft):
        """``draft`` loaded once per folder (None: the shipped default, if any); a loaded draft is
        returned as it is."""
        if draft is not None and not isinstance(draft, (str, bytes)) and not hasattr(draft, "__fspath__"):
            return draft
        key = None if draft is None else str(draft)
        if key not in self._drafts:
            self._drafts[key] = resolve_draft(draft, self.target())
        return self._drafts[key]

    def proposer(self, name: str, draft, window: int = 512):
        """The proposer for ``name`` over ``draft`` (one per name, draft and window)."""
        key = (name, None if name in ("pld", "none") else id(draft), window if name == "streaming" else None)
        if key not in self._proposers:
            self._proposers[key] = (build_proposer(name, self.target(), draft, window), draft)
        return self._proposers[key][0]

    def controller(self, engine: Engine, draft) -> Controller:
        """auto's controller of ``engine`` (made on first use)."""
        if engine not in self._controllers:
            self._controllers[engine] = new_controller(self.target(), draft)
        return self._controllers[engine]

    def replace(self, key, proposer=None) -> None:
        """Closes the engine of ``key`` and any engine that holds ``proposer`` (a proposer's state
        belongs to one engine), before a new one is built: their pools are freed first."""
        for other in [k for k, e in self.engines.items()
                      if k == key or (proposer is not None and e.proposer is proposer)]:
            self.engines.pop(other).close()

    def get(self, key) -> Optional[Engine]:
        return self.engines.get(key)


def new_controller(target: TargetModel, draft) -> Controller:
    """An ``auto`` controller whose corrections of the cost model (what it learns about a
    checkpoint's acceptance) are kept for the next process beside the step costs (for a
    checkpoint on disk)."""
    offset = target.device.type != "cuda"  # (see Controller: eager steps on a CPU, graphs on CUDA)
    if target.path is None:
        return Controller(offset=offset)
    return Controller(str(home_dir() / CORRECTIONS_FILE), corrections_key(target, draft), offset=offset)
