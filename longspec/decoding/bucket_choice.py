"""Trees for a serving engine's batch buckets (``longspec serve --bucket-trees``): per bucket,
the tree with the most expected tokens per second at that batch, or plain rounds, from the
cost model of :mod:`longspec.decoding.auto` measured at that batch."""
from __future__ import annotations

from typing import Optional, Sequence

from ..engine.runner import batch_buckets
from ..spec.acceptance import expected_tokens
from ..spec.drafting import takes_lookup
from ..spec.tree import TreeSpec
from .auto import CANDIDATE_TREES
from .step_costs import choose


def bucket_trees(target, proposer, tree: TreeSpec, buckets: Sequence[int], context: int,
                 costs_file: Optional[str] = None) -> tuple:
    """Trees for a serving engine's batch buckets: for each bucket, the candidate (``tree`` and
    every :data:`CANDIDATE_TREES` shape that fits it and suits ``proposer``) with the most
    expected tokens per second at that batch, from the draft's acceptance table and costs
    measured at that batch (:func:`choose`), or None (plain rounds) where plain decoding is
    predicted faster than every tree. Returns ({bucket: tree or None} for the buckets that do not
    draft ``tree``, one line per bucket saying why)."""
    draft = getattr(proposer, "draft", None)
    if draft is None or not draft.config.acceptance:
        return {}, [f"no draft acceptance table: every bucket drafts {tree}"]

    lookup = getattr(proposer, "lookup", None)
    fits = []
    for shape in (str(tree), *CANDIDATE_TREES):
        t = TreeSpec.parse(shape)
        if t.fits_in(tree) and (lookup is None or takes_lookup(t)) and t not in fits:
            fits.append(t)
    name = "hybrid" if lookup is not None else "longspec"
    candidates = {f"{name} {t}": (t, lambda: type(proposer)(draft, type(lookup)() if lookup is not None else None),
                                  expected_tokens(t, draft.config.acceptance)) for t in fits}
    chosen, lines = {}, []
    for b in buckets:
        label, gain, _ = choose(target, candidates, context, costs_file, batch=b)
        if label is None:
            chosen[b] = None
            lines.append(f"bucket {b}: plain decoding (no tree predicted faster)")
            continue
        best = candidates[label][0]
        if best != tree:
            chosen[b] = best
        lines.append(f"bucket {b}: {best} ({gain:.2f}x plain decoding predicted)")
    return chosen, lines


def bucket_trees_option(spec: str, proposer: str, tree, buckets, max_batch: int):
    """``--bucket-trees``, checked before anything loads: "auto" (the cost model picks, for the
    draft-based proposers), "off" (every bucket drafts ``tree``) or "B=TREE;B=TREE" (TREE "plain":
    that bucket decodes plainly) -> "auto", {} or {bucket: TreeSpec or None}, each a bucket of the
    engine (``buckets``, ``max_batch``) whose tree fits ``tree``. Raises ValueError."""
    if spec == "off" or proposer == "none":
        if spec not in ("off", "auto"):
            raise ValueError("--bucket-trees needs a proposer")
        return {}
    if spec == "auto":
        return "auto" if proposer in ("longspec", "hybrid") else {}
    out = {}
    for item in spec.split(";"):
        bucket, sep, shape = item.partition("=")
        try:
            out[int(bucket)] = None if shape.strip().lower() == "plain" else TreeSpec.parse(shape)
        except ValueError as err:
            detail = "" if sep else " (expected BUCKET=TREE)"
            raise ValueError(f"--bucket-trees takes auto, off or 'B=TREE;B=TREE' (e.g. '16=2,2,2'): "
                             f"{item!r}{detail}: {err}") from None
    known = batch_buckets(max_batch, buckets)
    for b, t in out.items():
        if b not in known:
            raise ValueError(f"--bucket-trees names batch size {b}, which is not a bucket ({known})")
        if t is not None and not t.fits_in(tree):
            raise ValueError(f"--bucket-trees: the tree {t} of bucket {b} does not fit --tree {tree} "
                             "(no deeper, no more nodes)")
    return out


def choose_bucket_trees(target, proposer, tree, buckets, max_batch: int, max_len: int) -> tuple:
    """What ``--bucket-trees auto`` gives: ({bucket: tree, or None for plain rounds}, a note to
    print or ""). On CUDA the cost model (:func:`bucket_trees`, at half ``max_len``) picks for
    every bucket of 2 or more rows; a lone request keeps ``tree`` (the model does not see the
    lookup chain's hits on its text). On a CPU every bucket keeps it: measuring them all eagerly
    takes minutes."""
    if target.device.type != "cuda":
        return {}, ""
    shared = [b for b in batch_buckets(max_batch, buckets) if b > 1]
    if not shared:
        return {}, "one bucket"
    chosen, lines = bucket_trees(target, proposer, tree, shared, max_len // 2)
    return chosen, "; ".join(lines)
