"""Tree verification: greedy acceptance and lossless stochastic acceptance (DESIGN.md 2.3).

Both rules take a ``DraftTree`` and the target's output for every tree node (node ``i``'s row is
the target's next-token logits/probabilities after the path root..i) and return a
``VerifyResult``: the accepted root->node path, the accepted draft tokens and one bonus token.
A step emits ``num_accepted + 1`` tokens (accepted drafts + bonus).

Everything is vectorised over the batch. ``verify_greedy`` has no loop over nodes or vocabulary;
``verify_sampling`` loops over depth and sibling rank only when children were sampled from the
draft, with bounds known on the host: no function here synchronises with the device (given a
tree whose level sizes are known).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .draft_tree import DraftTree
from .sampling import check_sampling_args, sample, uniform, warp_probs

__all__ = ["VerifyResult", "verify_greedy", "verify_sampling", "verify_tree"]


@dataclass
class VerifyResult:
    """Outcome of verifying a batch of trees (``D`` = tree depth).

    Attributes:
        accepted_nodes: ``[B, D+1]`` long node indices of the accepted path, root at column 0,
            padded with ``-1``.
        num_accepted: ``[B]`` long number of accepted DRAFT tokens (root and bonus excluded).
        accepted_tokens: ``[B, D]`` long accepted draft tokens, padded with ``-1``.
        bonus_token: ``[B]`` long token sampled/argmaxed at the last accepted node.
    """

    accepted_nodes: torch.Tensor
    num_accepted: torch.Tensor
    accepted_tokens: torch.Tensor
    bonus_token: torch.Tensor

    def emitted(self):
        """Tokens emitted by this step: ``(tokens [B, D+1], lengths [B])``, where row ``b`` holds
        the accepted draft tokens followed by the bonus token, padded with ``-1``;
        ``lengths = num_accepted + 1``."""
        B, D = self.accepted_tokens.shape
        out = torch.cat([self.accepted_tokens, self.accepted_tokens.new_full((B, 1), -1)], dim=1)
        out.scatter_(1, self.num_accepted.unsqueeze(1), self.bonus_token.unsqueeze(1))
        return out, self.num_accepted + 1


def _result(tree: DraftTree, accepted_nodes: torch.Tensor, bonus: torch.Tensor) -> VerifyResult:
    drafts = accepted_nodes[:, 1:]
    ok = drafts >= 0
    tokens = torch.where(ok, tree.tokens.gather(1, drafts.clamp(min=0)), torch.full_like(drafts, -1))
    return VerifyResult(accepted_nodes, ok.sum(-1), tokens, bonus)


def _check_target(tree: DraftTree, target: torch.Tensor, name: str) -> None:
    if target.dim() != 3 or tuple(target.shape[:2]) != (tree.batch_size, tree.num_nodes):
        raise ValueError(
            f"{name} must be [B, N, V] with B, N = {tree.batch_size}, {tree.num_nodes}, got {tuple(target.shape)}"
        )


# --------------------------------------------------------------------------------------------
# Greedy
# --------------------------------------------------------------------------------------------


def verify_greedy(tree: DraftTree, target_logits: torch.Tensor, tokens_given: bool = False) -> VerifyResult:
    """Greedy acceptance (temperature 0).

    Node ``i > 0`` is correct iff ``tokens[i] == argmax(target_logits[parent[i]])``. The accepted
    node is the deepest one whose whole path (root excluded) is correct; among equally deep
    candidates (duplicate sibling tokens) the lowest index wins. The bonus token is the argmax at
    the accepted node. The emitted tokens equal greedy decoding with the target.

    Args:
        tree: the draft tree, ``N`` nodes.
        target_logits: ``[B, N, V]``; row ``i`` = target logits for the token after node ``i``.
        tokens_given: ``target_logits`` is already the target's token per node, ``[B, N]``.
    """
    if tokens_given:
        argmax = target_logits
    else:
        _check_target(tree, target_logits, "target_logits")
        argmax = target_logits.argmax(dim=-1)  # [B, N]
    B, N = tree.tokens.shape
    D = tree.depth
    expected = argmax.gather(1, tree.parents.clamp(min=0))
    correct = tree.tokens == expected
    correct[:, 0] = True
    path_ok = ~(tree.mask & ~correct.unsqueeze(1)).any(-1)  # [B, N]: all ancestors-or-self correct
    key = torch.where(path_ok, tree.depths, torch.full_like(tree.depths, -1))
    best = key.argmax(dim=-1)  # first (lowest-index) maximum
    on_path = tree.mask[torch.arange(B, device=best.device), best]  # [B, N]
    col = torch.where(on_path, tree.depths, torch.full_like(tree.depths, D + 1))
    nodes = torch.arange(N, device=best.device).expand(B, N)
    accepted = torch.full((B, D + 2), -1, dtype=torch.long, device=best.device)
    accepted.scatter_(1, col, nodes)
    bonus = argmax.gather(1, best.unsqueeze(1)).squeeze(1)
    return _result(tree, accepted[:, : D + 1], bonus)


# --------------------------------------------------------------------------------------------
# Lossless sampling
# --------------------------------------------------------------------------------------------


def _normalise(r: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Rows of ``r [B, V]`` normalised to sum 1; rows with no mass fall back to ``fallback``."""
    s = r.sum(-1, keepdim=True)
    return torch.where(s > 0, r / s.clamp(min=torch.finfo(r.dtype).tiny), fallback)


def _drop_token(dist: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """``dist [B, V]`` with ``dist[b, token[b]] = 0``, renormalised."""
    return _normalise(dist.scatter(1, token.unsqueeze(1), 0.0), dist)


def _sampled_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Target distribution after rejecting a child sampled from ``q``: ``norm(max(0, p - q))``.

    In exact arithmetic the residual has positive mass whenever a rejection can happen; rows
    where it vanishes numerically fall back to ``p``.
    """
    return _normalise((p - q).clamp(min=0), p)


def _child_choices(tree: DraftTree, target_probs: torch.Tensor, generator) -> torch.Tensor:
    """[B, N]: per node, the token of the child its target sample y ~ p lands on, -2 where it
    lands on none (a leaf's always). Child x_j of a node (siblings in index order) takes y
    with probability p(x_j): one uniform u per node, times p's total, falls in [p(x_1) + .. +
    p(x_{j-1}), p(x_1) + .. + p(x_j)), past them: none. Only the children's probabilities and
    each node's total are read, never a draw from a node's whole distribution. Children whose
    token is -1 (a repeated sibling) are never taken."""
    B, N = tree.tokens.shape
    dev = tree.tokens.device
    rows = torch.arange(B, device=dev)[:, None]
    parents = tree.parents.clamp(min=0)
    real = (tree.tokens >= 0) & (tree.parents >= 0)
    p_child = torch.where(real, target_probs[rows, parents, torch.where(real, tree.tokens, 0)].float(), 0.0)  # [B, N]
    same = tree.parents[:, :, None] == tree.parents[:, None, :]
    # p of the siblings before i, and up to and with i: a sibling's lower bound is the same sum
    # over the same numbers as the sibling before's upper one (bit for bit: no gap, no overlap)
    below = torch.ones(N, N, dtype=torch.bool, device=dev).tril(-1)
    lower = ((same & below) * p_child[:, None, :]).sum(-1)
    upper = ((same & (below | torch.eye(N, dtype=torch.bool, device=dev))) * p_child[:, None, :]).sum(-1)
    total = target_probs.float().sum(-1).gather(1, parents)  # (1 up to rounding)
    u = uniform((B, N), generator, dev).gather(1, parents) * total  # the parent's number
    taken = real & (u >= lower) & (u < upper)
    choice = torch.full((B, N + 1), -2, dtype=torch.long, device=dev)
    return choice.scatter_(1, torch.where(taken, parents, N), tree.tokens)[:, :N]


def _bonus_after_rejection(p: torch.Tensor, children: torch.Tensor, generator) -> torch.Tensor:
    """Bonus token at the node where the walk stopped, whose sample landed on none of its
    children: p [B, V] without the children's tokens (children [B, N]: tokens, -1 none),
    renormalised (p itself where nothing is left: rounding)."""
    V = p.shape[-1]
    drop = torch.zeros(p.shape[0], V + 1, dtype=torch.bool, device=p.device)
    drop.scatter_(1, torch.where(children >= 0, children, V), True)
    return sample(_normalise(p.masked_fill(drop[:, :V], 0.0), p), generator)


def _verify_deterministic_children(tree: DraftTree, target_probs: torch.Tensor, generator) -> VerifyResult:
    """Deterministic children (top-k, beam). Trying the children in order, accepting child x
    with probability p(x) and renormalising p without x on rejection, accepts child x with
    probability exactly p(x) and, when all are rejected, emits a token from p without the
    children. Drawing one token y ~ p per node and moving to the child whose token is y (or
    stopping with y as the bonus) is the same process, so the walk is the greedy walk over
    each node's choice among its children (:func:`_child_choices`: no loop), and only the
    node where it stops samples from a whole distribution (a tree's other nodes' full draws
    were most of a sampled round's acceptance over a large vocabulary)."""
    # a child whose token an earlier sibling already has would be a second chance for the same
    # token (its rule sets p(x) = 0 after the first rejection): it never matches
    n = tree.num_nodes
    earlier = torch.ones(n, n, dtype=torch.bool, device=tree.tokens.device).tril(-1)
    dup = ((tree.parents[:, :, None] == tree.parents[:, None, :]) & (tree.tokens[:, :, None] == tree.tokens[:, None, :])
           & earlier).any(-1)
    if tree.valid is not None:  # nodes that are no proposal (a row with nothing to propose): never taken
        dup = dup | ~tree.valid
    tree = DraftTree(tree.tokens.masked_fill(dup, -1), tree.parents, tree.depths, tree.mask,
                     level_sizes=tree.level_sizes)
    walk = verify_greedy(tree, _child_choices(tree, target_probs, generator), tokens_given=True)
    last = walk.accepted_nodes.gather(1, walk.num_accepted[:, None]).squeeze(1)
    rows = torch.arange(tree.batch_size, device=last.device)
    children = torch.where(tree.parents == last[:, None], tree.tokens, -1)
    bonus = _bonus_after_rejection(target_probs[rows, last].float(), children, generator)
    return VerifyResult(walk.accepted_nodes, walk.num_accepted, walk.accepted_tokens, bonus)


def verify_sampling(
    tree: DraftTree, target_probs: torch.Tensor, generator=None
) -> VerifyResult:
    """Lossless stochastic acceptance: the emitted tokens are distributed exactly as sampling
    from ``target_probs`` token by token.

    Walk from the root; at the current node with target distribution ``p``:

    * ``tree.children_sampled == False`` (top-k / beam children): try the children in node-index
      order (proposers store siblings in descending draft probability); accept child ``x`` with
      probability ``p(x)``; on rejection ``p <- norm(p with p(x) = 0)`` (computed in one shot,
      see ``_verify_deterministic_children``).
    * ``tree.children_sampled == True`` (children drawn from ``q = draft_probs[node]``): accept
      ``x`` with probability ``min(1, p(x) / q(x))``; on rejection ``p <- norm(max(0, p - q))``,
      and for siblings drawn without replacement also ``q <- norm(q with q(x) = 0)``.

    On acceptance move to the child with a fresh ``p = target_probs[child]`` (and ``q``). When no
    child is accepted (or at a leaf), the bonus token is sampled from the current ``p``. Loop
    bounds come from the tree's level sizes: no host synchronisation.

    Args:
        tree: the draft tree.
        target_probs: ``[B, N, V]`` target distributions, already warped by ``warp_probs``.
        generator: optional ``torch.Generator`` on the tensors' device, or a
            :class:`~longspec.spec.sampling.Uniforms`.
    """
    _check_target(tree, target_probs, "target_probs")
    sampled = tree.children_sampled
    if not sampled:
        return _verify_deterministic_children(tree, target_probs, generator)
    _check_target(tree, tree.draft_probs, "draft_probs")
    if tree.draft_probs.shape[-1] != target_probs.shape[-1]:
        raise ValueError(
            f"draft_probs vocabulary {tree.draft_probs.shape[-1]} != target vocabulary {target_probs.shape[-1]}"
        )
    B, N = tree.tokens.shape
    D = tree.depth
    dev = tree.tokens.device
    rows = torch.arange(B, device=dev)
    node_ids = torch.arange(N, device=dev)

    cur = torch.zeros(B, dtype=torch.long, device=dev)
    active = torch.ones(B, dtype=torch.bool, device=dev)
    p = target_probs[:, 0].float()
    q = tree.draft_probs[:, 0].float()
    accepted = torch.full((B, D + 1), -1, dtype=torch.long, device=dev)
    accepted[:, 0] = 0

    for d in range(D):
        width = tree.level_width(d + 1)  # a node has at most as many children as the next level has nodes
        is_child = (tree.parents == cur.unsqueeze(1)) & active.unsqueeze(1)  # [B, N]
        # children of the current node in index order, padded with N
        children = torch.where(is_child, node_ids, N).sort(dim=-1).values[:, :width]
        moved = torch.zeros(B, dtype=torch.bool, device=dev)
        nxt = cur
        u_all = uniform((B, width), generator, dev)
        for k in range(width):
            node = children[:, k]
            trying = active & ~moved & (node < N)
            if tree.valid is not None:
                trying = trying & tree.valid.gather(1, node.clamp(max=N - 1).unsqueeze(1)).squeeze(1)
            x = tree.tokens.gather(1, node.clamp(max=N - 1).unsqueeze(1)).squeeze(1)
            px = p.gather(1, x.unsqueeze(1)).squeeze(1)
            qx = q.gather(1, x.unsqueeze(1)).squeeze(1)
            acc = trying & (u_all[:, k] * qx < px)  # u < min(1, p/q); q(x) = 0 accepts iff p(x) > 0
            rej = (trying & ~acc).unsqueeze(1)
            p = torch.where(rej, _sampled_residual(p, q), p)
            if tree.without_replacement:
                q = torch.where(rej, _drop_token(q, x), q)
            moved = moved | acc
            nxt = torch.where(acc, node, nxt)
        active = moved
        cur = nxt
        accepted[:, d + 1] = torch.where(moved, cur, -1)
        p = torch.where(moved.unsqueeze(1), target_probs[rows, cur].float(), p)
        q = torch.where(moved.unsqueeze(1), tree.draft_probs[rows, cur].float(), q)

    bonus = sample(p, generator)
    return _result(tree, accepted, bonus)


def verify_tree(
    tree: DraftTree,
    target_logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: Optional[int] = 0,
    top_p: Optional[float] = 1.0,
    generator: Optional[torch.Generator] = None,
) -> VerifyResult:
    """Dispatch: ``temperature == 0`` -> ``verify_greedy``; otherwise warp the target logits with
    ``warp_probs`` and run ``verify_sampling``. ``target_logits``: ``[B, N, V]``. The settings may
    be tensors with one value per row (:class:`~longspec.spec.sampling.RowSampling`): rows at
    temperature 0 then get one-hot target distributions, which the sampling rules verify exactly
    as the greedy rule does."""
    if torch.is_tensor(temperature):
        return verify_sampling(tree, warp_probs(target_logits, temperature, top_k, top_p), generator)
    check_sampling_args(temperature, top_k, top_p)
    if temperature == 0:
        return verify_greedy(tree, target_logits)
    return verify_sampling(tree, warp_probs(target_logits, temperature, top_k, top_p), generator)
