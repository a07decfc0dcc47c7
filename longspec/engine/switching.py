"""Switching an :class:`~longspec.engine.engine.Engine`'s rounds between trees (and plain
rounds) while it generates, as ``--proposer auto``'s controller chooses, with the proposer
catching up on the rows' text when a tree that needs its whole state takes over."""
from __future__ import annotations

from typing import Optional

from ..spec.tree import TreeSpec


class TreeSwitching:
    """The part of :class:`~longspec.engine.engine.Engine` that changes the tree its buckets
    draft. It works on the engine's state (``proposer``, ``tree``, ``rows``, ``buckets``,
    ``bucket_trees``, ``runners``, ``parked``, ``_views``, ``behind``, ``_in_flight``, ``fitting``)
    through its ``tree_of``."""

    def use_tree(self, tree: Optional[TreeSpec]) -> None:
        """From the next round on every bucket drafts ``tree`` (one that fits the engine's tree),
        or decodes plainly (None): what ``--proposer auto`` switches to while it generates.
        Verification stays exact, so the output is unchanged. The replaced tree's rounds are
        parked (graphs and times kept) for when it returns. Plain rounds leave the proposer
        behind (they cost what a plain engine's do), and so do rounds it drafts with part of its
        state (:meth:`Proposer.keeps_up`: the hybrid's lookup chain without its draft); when the
        next tree takes over, the proposer takes every active row in again from its text
        (:meth:`Proposer.add`: the draft's window of the last W tokens, the lookup's history), as
        after the row's prefill."""
        if self.proposer is None:
            raise ValueError("use_tree needs an engine with a proposer")
        if self.waits_for_rounds(tree):
            raise RuntimeError("use_tree to a tree that takes the rows in: a round other than one plain round "
                               "is running")
        if tree is not None and any(s is not None and s.plain_rounds for s in self.rows):
            raise ValueError("a row holds room for plain rounds only: no tree while it is active")
        if tree is not None and tree != self.tree and tree not in self.fitting:
            # raises for a tree that does not fit or suit the proposer; once: it copies the tree's
            # indices to the device, which waits for the rounds in flight (from pageable memory)
            self.proposer.with_tree(tree)
            self.fitting.add(tree)
        if self.takes_rows_in(tree):
            behind = {id(r) for r in self._in_flight[0][2]} if self._in_flight else set()  # (a plain round's rows)
            for s in filter(None, self.rows):
                if id(s) in behind:  # (behind that round: the text up to its root, then the token it makes)
                    self.take_in(s.row, s.text(len(s.tokens)), self.root[s.row], tree)
                else:
                    self.take_in(s.row, s.text(len(s.tokens) - 1), s.tokens[-1], tree)
            self.behind = False
        for b in self.buckets:
            old = self.tree_of(b)
            if old == tree:
                continue
            runners = {key: self.runners.pop(key) for key in [k for k in self.runners if k[-1] == b]}
            self.parked[b, old] = (self._views.pop(b, None), runners)
            view, runners = self.parked.pop((b, tree), (None, {}))
            if view is not None:
                self._views[b] = view
            self.runners.update(runners)
            if tree == self.tree:
                del self.bucket_trees[b]
            else:
                self.bucket_trees[b] = tree
        self.behind = self.behind or tree is None or not self.proposer.keeps_up(tree)

    def takes_rows_in(self, tree: Optional[TreeSpec]) -> bool:
        """Whether :meth:`use_tree` to ``tree`` has the proposer take every active row in (it reads
        their text). Any other switch may come while rounds run (launched ahead): the rounds
        launched after it run the new tree, in the device's order, and those in flight finish
        with what they ran."""
        return tree is not None and self.behind and tree != self.tree_of(self.buckets[0])

    def waits_for_rounds(self, tree: Optional[TreeSpec]) -> bool:
        """Whether :meth:`use_tree` to ``tree`` must wait until the rounds in flight are finished:
        it takes the rows in, and they are not one plain round. Behind one plain round the rows'
        text is the host's and their next token the round's own on the device: the proposer takes
        them in behind it, in the device's order, and the device does not wait for the switch
        (the draft's window is rebuilt while the round runs; tokens of a tree's round in flight
        are not known until it ends)."""
        return self.takes_rows_in(tree) and bool(self._in_flight) and not (
            len(self._in_flight) == 1 and self._in_flight[0][0].tree is None)

    def take_in(self, row: int, text, last, tree: Optional[TreeSpec]) -> None:
        """The proposer takes row ``row`` in (its ``text`` up to its ``last`` token, whose K/V
        is not cached yet: ids as an array or a tensor on the device, an int or a 0-d tensor)
        for rounds of ``tree``. While the proposer is behind (:meth:`use_tree` switched every
        bucket to rounds that leave it behind; the next tree's takes every row in again):
        nothing for plain rounds, and for rounds that use part of its state (the hybrid's lookup
        chain) only that part (the lookup's history, not the draft's window)."""
        if not self.behind or tree is not None and self.proposer.keeps_up(tree):
            self.proposer.add(row, text, last)
        elif tree is not None:
            self.proposer.add(row, text, last, tree=tree)
