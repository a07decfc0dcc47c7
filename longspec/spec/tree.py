"""Token trees for speculation: shapes (``TreeSpec``) and parent-array helpers (the batched drafts,
``DraftTree``, are in :mod:`longspec.spec.draft_tree`).

Conventions used throughout speculation (``longspec.spec``, ``longspec.engine``):

* Node 0 is the ROOT: the last accepted token, whose target K/V is not cached yet. Nodes
  ``1..N-1`` are draft tokens. Nodes are stored in topological order (``parent < index``) and
  grouped by depth (all depth-``d`` nodes before depth-``d+1`` nodes).
* Siblings are stored in descending draft probability (lower index = more likely). The
  deterministic verification rule tries siblings in index order.
* ``mask[i, j]`` is True iff node ``j`` is an ancestor of node ``i`` or ``i`` itself.

Tree shapes: a chain (``"chain:5"``), a static tree given as paths of child ranks
(``TreeSpec.from_paths([[0], [1], [0, 0]])``, EAGLE/Medusa style) and the LongSpec beam tree of
per-depth widths (``"4,16,16,16,16"``), whose parent structure is decided at draft time.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence

import torch

DEFAULT_TREE = "4,16,16,16,16"  # the paper's beam tree
HYBRID_TREE = DEFAULT_TREE + ",1,1,1,1,1"  # the lookup chain alone past the beam (hybrid proposer)

__all__ = [
    "DEFAULT_TREE",
    "HYBRID_TREE",
    "TreeSpec",
    "ancestor_mask_from_parents",
    "depths_from_parents",
]


# --------------------------------------------------------------------------------------------
# Parent-array utilities (batched)
# --------------------------------------------------------------------------------------------


def ancestor_mask_from_parents(parents: torch.Tensor) -> torch.Tensor:
    """Ancestor-or-self mask from parent pointers.

    Args:
        parents: ``[B, N]`` (or ``[N]``) long, ``-1`` for the root.
    Returns:
        ``[B, N, N]`` (or ``[N, N]``) bool, ``mask[b, i, j]`` = node ``j`` is ``i`` or an ancestor of ``i``.
    Loops over depth (pointer chasing), not over nodes.
    """
    squeeze = parents.dim() == 1
    par = parents.unsqueeze(0) if squeeze else parents
    B, N = par.shape
    idx = torch.arange(N, device=par.device).expand(B, N)
    mask = torch.eye(N, dtype=torch.bool, device=par.device).expand(B, N, N).clone()
    anc = par.clone()
    for _ in range(N):
        valid = anc >= 0
        if not bool(valid.any()):
            break
        # invalid pointers write into the diagonal, which is already True
        col = torch.where(valid, anc, idx)
        mask.scatter_(2, col.unsqueeze(-1), True)
        anc = torch.where(valid, par.gather(1, anc.clamp(min=0)), anc)
    else:
        raise ValueError("parents contain a cycle (not a tree)")
    return mask[0] if squeeze else mask


def depths_from_parents(parents: torch.Tensor) -> torch.Tensor:
    """Depth of every node (root = 0) from parent pointers.

    Args:
        parents: ``[B, N]`` (or ``[N]``) long, ``-1`` for the root.
    Returns:
        ``[B, N]`` (or ``[N]``) long.
    """
    depth = torch.zeros_like(parents)
    anc = parents.clone()
    for _ in range(parents.shape[-1]):
        valid = anc >= 0
        if not bool(valid.any()):
            return depth
        depth += valid.long()
        anc = torch.where(valid, parents.gather(-1, anc.clamp(min=0)), anc)
    raise ValueError("parents contain a cycle (not a tree)")


# --------------------------------------------------------------------------------------------
# Tree shapes
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeSpec:
    """Shape of a speculation tree.

    ``kind`` is ``"chain"`` or ``"paths"`` (static: node structure fixed, see ``paths``) or
    ``"beam"`` (``widths[d-1]`` nodes at depth ``d``; parents chosen at draft time by cumulative
    draft log-probability, see ``beam_select``). For static kinds ``paths`` holds every non-root
    node as its tuple of child ranks from the root, in node order (node ``i`` = ``paths[i-1]``):
    sorted by depth, then lexicographically, so siblings are in rank order.

    Build with ``TreeSpec.parse``, ``TreeSpec.chain``, ``TreeSpec.beam`` or ``TreeSpec.from_paths``.
    """

    kind: str
    widths: tuple = ()
    paths: tuple = ()

    def __post_init__(self):
        if self.kind == "beam":
            w = tuple(self.widths)
            if not w:
                raise ValueError("beam tree needs at least one width")
            for x in w:
                if isinstance(x, bool) or not isinstance(x, int) or x <= 0:
                    raise ValueError(f"beam tree widths must be positive integers, got {list(w)}")
            object.__setattr__(self, "widths", w)
            object.__setattr__(self, "paths", ())
        elif self.kind in ("chain", "paths"):
            object.__setattr__(self, "paths", _canonical_paths(self.paths))
            if self.kind == "chain" and any(any(r != 0 for r in p) for p in self.paths):
                raise ValueError("a chain has only rank-0 children")
            object.__setattr__(self, "widths", tuple(self._level_sizes_static()))
        else:
            raise ValueError(f"unknown tree kind {self.kind!r} (expected 'chain', 'paths' or 'beam')")

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def chain(cls, length: int) -> "TreeSpec":
        """A chain of ``length`` draft tokens (depth ``length``)."""
        if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
            raise ValueError(f"chain length must be a positive integer, got {length!r}")
        return cls("chain", paths=tuple((0,) * d for d in range(1, length + 1)))

    @classmethod
    def beam(cls, widths: Sequence[int]) -> "TreeSpec":
        """Beam tree with ``widths[d-1]`` nodes at depth ``d``."""
        return cls("beam", widths=tuple(widths))

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> "TreeSpec":
        """Static tree from paths of child ranks (rank i = the draft's i-th most likely child)."""
        return cls("paths", paths=paths)

    @classmethod
    def parse(cls, text: str) -> "TreeSpec":
        """Parse ``"chain:N"``, ``"W1,W2,..."`` / ``"beam:W1,W2,..."`` or ``"[[0],[1],[0,0]]"`` /
        ``"paths:[[0],...]"``."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("empty tree spec (expected e.g. 'chain:5', '4,16,16,16,16' or '[[0],[1],[0,0]]')")
        s = "".join(text.split())
        low = s.lower()
        try:
            if low.startswith("chain:"):
                return cls.chain(_parse_int(s[6:]))
            if low.startswith("paths:") or s.startswith("["):
                body = s[6:] if low.startswith("paths:") else s
                try:
                    paths = json.loads(body)
                except json.JSONDecodeError as err:
                    raise ValueError(f"paths are not a JSON list of lists ({err.msg})") from None
                return cls.from_paths(paths)
            body = s[5:] if low.startswith("beam:") else s
            return cls.beam([_parse_int(x) for x in body.split(",")])
        except ValueError as err:
            raise ValueError(
                f"invalid tree spec {text!r}: {err} "
                "(expected 'chain:N', 'W1,W2,...' (beam widths) or a JSON list of paths like '[[0],[1],[0,0]]')"
            ) from None

    @classmethod
    def coerce(cls, tree) -> "TreeSpec":
        """A ``TreeSpec`` from any accepted form: a ``TreeSpec``; a string (see ``parse``); a list or
        tuple of beam widths (``[4, 16, 16, 16, 16]``); a list of paths (``[[0], [1], [0, 0]]``)."""
        if isinstance(tree, TreeSpec):
            return tree
        if isinstance(tree, str):
            return cls.parse(tree)
        if isinstance(tree, (list, tuple)) and tree:
            if all(isinstance(x, int) and not isinstance(x, bool) for x in tree):
                return cls.beam(tree)
            if all(isinstance(x, (list, tuple)) for x in tree):
                return cls.from_paths(tree)
            raise ValueError(f"a tree given as a list holds beam widths (ints) or paths (lists of ranks), got {tree!r}")
        raise ValueError(f"a tree is a TreeSpec, a string like '4,16,16,16,16' or 'chain:5', a list of beam widths "
                         f"or a list of paths; got {type(tree).__name__} {tree!r}")

    def __str__(self) -> str:
        if self.kind == "chain":
            return f"chain:{self.depth}"
        if self.kind == "beam":
            return ",".join(str(w) for w in self.widths)
        return json.dumps([list(p) for p in self.paths], separators=(",", ":"))

    # ---- shape --------------------------------------------------------------------------
    @property
    def is_static(self) -> bool:
        """True for chain and paths trees (parent structure known before drafting)."""
        return self.kind != "beam"

    @property
    def depth(self) -> int:
        """Number of draft levels ``D``."""
        return len(self.widths)

    @property
    def level_sizes(self) -> tuple:
        """Number of nodes at depth ``1..D``."""
        return self.widths

    @property
    def num_nodes(self) -> int:
        """Number of nodes ``N`` including the root."""
        return 1 + sum(self.widths)

    @property
    def lookup_tail(self) -> int:
        """Trailing one-node levels of a beam tree that is wider before them (``4,16,16,1,1``: 2):
        in a hybrid round prompt lookup's chain alone fills them, without running the draft."""
        if self.kind != "beam" or max(self.widths) == 1:
            return 0
        return len(self.widths) - 1 - max(i for i, w in enumerate(self.widths) if w > 1)

    @property
    def max_width(self) -> int:
        """Largest number of nodes at one depth."""
        return max(self.widths)

    @property
    def max_children(self) -> int:
        """Top-k a proposer needs per node: ``1 + max child rank`` (beam: the widest level)."""
        if self.kind == "beam":
            return max(self.widths)
        return 1 + max(p[-1] for p in self.paths)

    def fits_in(self, other: "TreeSpec") -> bool:
        """No deeper than ``other`` and with no more nodes: state sized for ``other`` holds it."""
        return self.depth <= other.depth and self.num_nodes <= other.num_nodes

    def node_depth(self, node: int) -> int:
        """The depth of node number ``node`` (a Python int: no tensor read)."""
        return next(d for d in range(self.depth + 1) if node < self.level_slice(d).stop)

    def level_slice(self, depth: int) -> slice:
        """Node indices at ``depth`` (0 = root) as a slice."""
        if not 0 <= depth <= self.depth:
            raise ValueError(f"depth {depth} outside [0, {self.depth}]")
        start = 1 + sum(self.widths[: depth - 1]) if depth > 0 else 0
        return slice(start, start + (self.widths[depth - 1] if depth > 0 else 1))

    def validate(self, vocab_size: int, max_cache_room: Optional[int] = None) -> None:
        """Check the shape against the vocabulary and the free cache slots.

        ``max_cache_room``: how many more positions the target cache can take; a verify step
        writes all ``num_nodes`` nodes (root included) into it.
        """
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        if self.kind == "beam":
            if self.widths[0] > vocab_size:
                raise ValueError(f"beam width {self.widths[0]} at depth 1 exceeds the vocabulary size {vocab_size}")
            for d in range(1, self.depth):
                if self.widths[d] > self.widths[d - 1] * vocab_size:
                    raise ValueError(
                        f"beam width {self.widths[d]} at depth {d + 1} exceeds the {self.widths[d - 1]} x "
                        f"{vocab_size} candidates of depth {d}"
                    )
        elif self.max_children > vocab_size:
            raise ValueError(f"tree needs the top-{self.max_children} children but the vocabulary has {vocab_size} tokens")
        if max_cache_room is not None and self.num_nodes > max_cache_room:
            raise ValueError(
                f"tree {self} needs {self.num_nodes} cache slots (depth {self.depth}) but only {max_cache_room} are left"
            )

    # ---- static buffers (CPU tensors; do not modify) -------------------------------------
    def _require_static(self, what: str) -> None:
        if not self.is_static:
            raise ValueError(f"{what} of a beam tree is decided at draft time; use ancestor_mask_from_parents")

    @cached_property
    def depths(self) -> torch.Tensor:
        """``[N]`` long depth of every node (known for every kind)."""
        return torch.tensor([0] + [d + 1 for d, w in enumerate(self.widths) for _ in range(w)], dtype=torch.long)

    @cached_property
    def parents(self) -> torch.Tensor:
        """``[N]`` long parent index, ``-1`` for the root (static kinds only)."""
        self._require_static("parents")
        index = {(): 0}
        index.update({p: i + 1 for i, p in enumerate(self.paths)})
        return torch.tensor([-1] + [index[p[:-1]] for p in self.paths], dtype=torch.long)

    def level_index(self, depth: int) -> tuple:
        """Where the depth-``depth`` nodes of a static tree come from: ``(parent, rank)`` [n_d] long
        CPU tensors, the parent's index within depth ``depth - 1`` and the child's rank among that
        parent's draft top-k (``tokens[level] = topk[:, parent, rank]``)."""
        self._require_static("level_index")
        cur, prev = self.level_slice(depth), self.level_slice(depth - 1)
        return self.parents[cur] - prev.start, self.child_rank[cur]

    @cached_property
    def child_rank(self) -> torch.Tensor:
        """``[N]`` long rank of each node among its parent's draft top-k, ``-1`` for the root."""
        self._require_static("child_rank")
        return torch.tensor([-1] + [p[-1] for p in self.paths], dtype=torch.long)

    @cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """``[N, N]`` bool ancestor-or-self mask."""
        return ancestor_mask_from_parents(self.parents)

    @cached_property
    def leaf_paths(self) -> torch.Tensor:
        """``[num_leaves, D+1]`` long node indices root->leaf, padded with ``-1``."""
        par = self.parents
        is_leaf = torch.ones(self.num_nodes, dtype=torch.bool)
        is_leaf[par[1:]] = False
        rows = []
        for leaf in torch.nonzero(is_leaf).flatten().tolist():
            path = self.ancestor_mask[leaf].nonzero().flatten().tolist()  # ascending = root first
            rows.append(path + [-1] * (self.depth + 1 - len(path)))
        return torch.tensor(rows, dtype=torch.long)

    def _level_sizes_static(self) -> list:
        sizes = [0] * max(len(p) for p in self.paths)
        for p in self.paths:
            sizes[len(p) - 1] += 1
        return sizes


def _parse_int(s: str) -> int:
    try:
        return int(s)
    except ValueError:
        raise ValueError(f"{s!r} is not an integer") from None


def _canonical_paths(paths) -> tuple:
    if paths is None or isinstance(paths, (str, bytes)) or not hasattr(paths, "__iter__"):
        raise ValueError(f"paths must be a list of lists of child ranks, got {paths!r}")
    out = []
    for p in paths:
        if isinstance(p, (str, bytes)) or not hasattr(p, "__iter__"):
            raise ValueError(f"each path must be a list of child ranks, got {p!r}")
        p = tuple(p)
        if not p:
            raise ValueError("empty path (the root is implicit)")
        for r in p:
            if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                raise ValueError(f"path {list(p)} has an invalid rank {r!r} (ranks are integers >= 0)")
        out.append(p)
    if not out:
        raise ValueError("a tree needs at least one path")
    seen = set(out)
    if len(seen) != len(out):
        dup = next(p for p in out if out.count(p) > 1)
        raise ValueError(f"duplicate path {list(dup)}")
    for p in out:
        if len(p) > 1 and p[:-1] not in seen:
            raise ValueError(f"path {list(p)} lacks its prefix {list(p[:-1])}")
    return tuple(sorted(out, key=lambda p: (len(p), p)))
