"""What a process keeps per target model, on the target itself (it goes with the target): the
long-lived engines of its :class:`~longspec.decoding.generator.Generator` calls, the drafts and
proposers they share, and ``auto``'s controller of each engine."""
from __future__ import annotations

import weakref

from ..convert import home_dir
from ..models.target import TargetModel
from ..spec.proposers import build_proposer, resolve_draft
from .auto import corrections_key
from .controller import Controller

CORRECTIONS_FILE = "corrections.json"  # in the longspec home: what auto's controllers learned (see Controller)


def registry(target: TargetModel) -> dict:
    """{key: (object, what it keeps alive or refers to)}: the target's engines (key
    ``("engine", ...)``), drafts, proposers and controllers in this process."""
    if "_longspec_engines" not in target.__dict__:
        target.__dict__["_longspec_engines"] = {}
    return target.__dict__["_longspec_engines"]


def shared_draft(target: TargetModel, draft):
    """``draft`` loaded once per target and folder in this process (None: the shipped default, if
    any); a loaded draft is returned as it is."""
    if draft is not None and not isinstance(draft, (str, bytes)) and not hasattr(draft, "__fspath__"):
        return draft
    engines = registry(target)
    key = ("draft", None if draft is None else str(draft))
    if key not in engines:
        engines[key] = (resolve_draft(draft, target), None)
    return engines[key][0]


def shared_proposer(target: TargetModel, name: str, draft, window: int = 512):
    """The proposer for ``name`` over ``draft``: one per target, name and draft in this process,
    so that its engine (and graphs) serve every Generator that names it."""
    engines = registry(target)
    key = ("proposer", name, None if name in ("pld", "none") else id(draft), window if name == "streaming" else None)
    if key not in engines:
        engines[key] = (build_proposer(name, target, draft, window), draft)  # (the draft kept alive with it)
    return engines[key][0]


def new_controller(target: TargetModel, draft):
    """An ``auto`` controller whose corrections of the cost model (what it learns about a
    checkpoint's acceptance) are kept for the next process beside the step costs (for a
    checkpoint on disk)."""

    offset = target.device.type != "cuda"  # (see Controller: eager steps on a CPU, graphs on CUDA)
    if target.path is None:
        return Controller(offset=offset)

    return Controller(str(home_dir() / CORRECTIONS_FILE), corrections_key(target, draft), offset=offset)


def engine_controller(target: TargetModel, draft, engine):
    """auto's controller of ``engine``: one per engine in this process (what it measured serves
    the engine's later calls)."""
    engines = registry(target)
    for key in [k for k, (_, ref) in engines.items() if k[0] == "controller" and ref() is None]:
        del engines[key]  # (of engines gone since)
    key = ("controller", id(engine))
    if key not in engines or engines[key][1]() is not engine:
        engines[key] = (new_controller(target, draft), weakref.ref(engine))  # (not keeping a replaced engine alive)
    return engines[key][0]
