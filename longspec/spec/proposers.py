"""Draft strategies behind one interface.

The :class:`~longspec.engine.engine.Engine` calls, per engine: ``begin``; per sequence: ``add``
after its prefill; per round: ``propose(root)`` -> :class:`~longspec.spec.draft_tree.DraftTree`,
then ``accepted(tokens, counts)`` with each row's newly emitted tokens (the interface:
:class:`Proposer`).

:class:`TreeDrafter` (:mod:`~longspec.spec.drafting`) grows any tree shape (chain, static
paths, beam widths) from a next-token distribution; the concrete proposers only say how to get
that distribution for a level of tree nodes:

* :class:`PromptLookup` (:mod:`~longspec.spec.prompt_lookup`) — n-gram match in the prompt +
  generated text (prompt lookup decoding);
* :class:`LongSpecProposer` (:mod:`~longspec.spec.longspec_proposer`) — the LongSpec draft,
  alone or with a prompt-lookup chain merged into its beam tree (the hybrid proposer);
* :class:`~longspec.spec.streaming.StreamingSelfSpec` — the target itself over a
  StreamingLLM view of its own KV cache (4 sink tokens + the last ``window`` tokens), the MagicDec
  baseline.

This module gathers them (``from longspec.spec.proposers import LongSpecProposer, ...``)
and builds one by name (:func:`build_proposer`)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..convert import DEFAULT_DRAFT, DEFAULT_NAME, home_dir
from ..models.checkpoint import load_draft
from ..models.layers import CPU_FEW_ROWS
from .drafting import Proposer, TreeDrafter, beam_select, takes_lookup, topk_children
from .longspec_proposer import LongSpecProposer
from .prompt_lookup import PromptLookup
from .streaming import StreamingSelfSpec
from .tree import DEFAULT_TREE, HYBRID_TREE

if TYPE_CHECKING:
    from ..models.target import TargetModel

__all__ = ["LongSpecProposer", "PromptLookup", "Proposer", "TreeDrafter", "beam_select", "takes_lookup",
           "topk_children", "build_proposer", "default_tree", "PROPOSERS"]

PROPOSERS = ("none", "pld", "streaming", "longspec", "hybrid", "auto")
PLD_TREE = "chain:5"
PLD_CPU_TREE = f"chain:{CPU_FEW_ROWS - 1}"  # the root + the chain: rows a CPU's few-row products cover


def default_tree(proposer: str, device: str = "cuda") -> str:
    """The tree for ``device`` (a type, or "cuda:N"). pld: a 5-token chain (on a CPU one that fits
    its few-row products, ``CPU_FEW_ROWS``: the chain of 5 was slower than plain decoding there,
    docs/benchmarks.md); longspec and streaming: the paper's beam tree; hybrid: that tree plus
    five levels of one node, which the lookup chain fills when the text repeats."""
    if proposer == "pld":
        return PLD_CPU_TREE if device.partition(":")[0] == "cpu" else PLD_TREE
    return {"hybrid": HYBRID_TREE}.get(proposer, DEFAULT_TREE)


def default_draft(target: TargetModel):
    """The draft shipped for the default model when ``target`` is it, else None."""
    shipped_for = home_dir() / "models" / DEFAULT_NAME
    if target.path is None or Path(target.path).resolve() != shipped_for.resolve():
        return None
    return load_draft(DEFAULT_DRAFT, target)


def build_proposer(name: str, target: TargetModel, draft=None, window: int = 512):
    """The proposer object for ``name`` (one of :data:`PROPOSERS` but "auto"; "none": None).
    ``draft``: a loaded LongSpec draft or a checkpoint folder, needed by "longspec" and "hybrid"
    (default: the draft shipped for the default model)."""
    if name == "none":
        return None
    if name == "pld":
        return PromptLookup()
    if name == "streaming":
        return StreamingSelfSpec(window=window)
    if name not in ("longspec", "hybrid"):
        raise ValueError(f"unknown proposer {name!r}; expected one of {', '.join(PROPOSERS)}")
    draft = resolve_draft(draft, target)
    if draft is None:
        raise ValueError(f"proposer {name!r} needs a LongSpec draft for this target: pass draft=<checkpoint folder> "
                         "(only the default model ships one)")
    return LongSpecProposer(draft, lookup=PromptLookup() if name == "hybrid" else None)


def resolve_draft(draft, target):
    if draft is None:
        return default_draft(target)
    if isinstance(draft, (str, bytes)) or hasattr(draft, "__fspath__"):
        return load_draft(draft, target)
    return draft


def proposer_family(proposer) -> str:
    """The name of a proposer object's kind (for its default tree)."""
    if isinstance(proposer, LongSpecProposer):
        return "hybrid" if proposer.lookup is not None else "longspec"
    if isinstance(proposer, StreamingSelfSpec):
        return "streaming"
    return "pld" if isinstance(proposer, PromptLookup) else "longspec"
