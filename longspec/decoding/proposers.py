"""Draft strategies behind one interface.

The :class:`~longspec.decoding.engine.Engine` calls, per engine: ``begin``; per sequence: ``add``
after its prefill; per round: ``propose(root)`` -> :class:`~longspec.decoding.tree.DraftTree`,
then ``accepted(tokens, counts)`` with each row's newly emitted tokens (the interface:
:class:`Proposer`).

:class:`TreeDrafter` (:mod:`~longspec.decoding.drafting`) grows any tree shape (chain, static
paths, beam widths) from a next-token distribution; the concrete proposers only say how to get
that distribution for a level of tree nodes:

* :class:`PromptLookup` (:mod:`~longspec.decoding.prompt_lookup`) — n-gram match in the prompt +
  generated text (prompt lookup decoding);
* :class:`LongSpecProposer` (:mod:`~longspec.decoding.longspec_proposer`) — the LongSpec draft,
  alone or with a prompt-lookup chain merged into its beam tree (the hybrid proposer);
* :class:`~longspec.decoding.streaming.StreamingSelfSpec` — the target itself over a
  StreamingLLM view of its own KV cache (4 sink tokens + the last ``window`` tokens), the MagicDec
  baseline.

This module gathers them: ``from longspec.decoding.proposers import LongSpecProposer, ...``.
"""
from .drafting import Proposer, TreeDrafter, beam_select, takes_lookup, topk_children
from .longspec_proposer import LongSpecProposer
from .prompt_lookup import PromptLookup

__all__ = ["LongSpecProposer", "PromptLookup", "Proposer", "TreeDrafter", "beam_select", "takes_lookup",
           "topk_children"]
