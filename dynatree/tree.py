"""Token trees and the pure functions that turn them into verification buffers.

Conventions used throughout the engine:

* Node 0 is the **root**: the last committed token (the previous iteration's bonus token).  Its
  key/value pair is not in the target cache yet, so the verification pass computes it together
  with the drafted nodes.  The root is known to be correct; it has depth 0 and parent -1.
* Every other node is a drafted token.  ``depth`` counts drafted tokens on the root-to-node
  path, so a node at depth ``d`` sits at sequence position ``prefix_len + d`` where
  ``prefix_len`` is the number of tokens already in the target cache (position of the root).
* Flattened trees are in BFS order: nodes sorted by depth, ties by creation order.  Hence
  ``parent[i] < i`` and a node's ancestors precede it, which the mask and the accept step rely on.

All tensor functions carry a leading batch dimension of 1 where the model expects one; batches
of trees are packed by the runners instead (runtime.Seq: one sequence per tree, not padding).
"""
from __future__ import annotations

import array

from dataclasses import dataclass, field

import torch

from .runtime import KeyMask


@dataclass
class Tree:
    """A drafted token tree (host-side lists; a few hundred nodes at most)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    logp: list[float]  # cumulative draft log-probability of the path; 0.0 at the root
    keep: list[int] | None = None  # nodes to verify (ancestor-closed); None = all
    grafted: set[int] = field(default_factory=set)  # nodes not drafted by the draft model (lookup.py)
    bar: float = 0.0  # expected tokens a further node must bring to pay for itself (budget.py; 0 = no budget)
    # each node's rank among its parent's draft proposals (0: the draft's first choice), what the
    # budget's calibration is keyed by; None for trees built by hand
    ranks: list[int] | None = None

    @classmethod
    def root_only(cls, token: int) -> "Tree":
        return cls([token], [-1], [0], [0.0], ranks=[0])

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def add(self, parent: int, token: int, logp: float, rank: int = 0) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.logp.append(logp)
        if self.ranks is not None:
            self.ranks.append(rank)
        return len(self.tokens) - 1


def bfs_order(depths: list[int]) -> list[int]:
    """Permutation that sorts nodes by depth, keeping creation order within a depth."""
    return sorted(range(len(depths)), key=lambda i: (depths[i], i))


def flatten_bfs(tree: Tree) -> tuple[Tree, list[int]]:
    """Return ``(tree in BFS order, order)`` where ``order[new_index] = old_index``.

    Trees grown level by level are already in BFS order and come back unchanged; trees grown
    best-first (DySpec's heap) are reordered.  If ``tree.keep`` is set, only those nodes
    (an ancestor-closed set containing the root) are kept.
    """
    if tree.keep is None:
        order = bfs_order(tree.depths)
        if order == list(range(len(order))):
            return tree, order
    else:
        order = sorted(tree.keep, key=lambda i: (tree.depths[i], i))
    new_index = {old: new for new, old in enumerate(order)}
    parents = [-1 if tree.parents[o] < 0 else new_index[tree.parents[o]] for o in order]
    return Tree([tree.tokens[o] for o in order], parents, [tree.depths[o] for o in order],
                [tree.logp[o] for o in order],
                grafted={new_index[o] for o in tree.grafted if o in new_index},
                ranks=None if tree.ranks is None else [tree.ranks[o] for o in order]), order


def best_chain(tree: Tree) -> list[int]:
    """The tree cut to one path (for a target that cannot verify branches: models._tree_problem):
    from the root, each step to the kept child of highest draft path probability (the first on
    ties).  Returns the path's nodes, root first -- ancestor-closed, so a ``keep``."""
    kept = set(tree.keep) if tree.keep is not None else None
    children: dict[int, list[int]] = {}
    for v in range(1, len(tree)):
        if kept is None or v in kept:
            children.setdefault(tree.parents[v], []).append(v)
    path = [0]
    while path[-1] in children:
        path.append(max(children[path[-1]], key=lambda v: (tree.logp[v], -v)))
    return path


def long_tensor(values: list[int], device: torch.device | None = None) -> torch.Tensor:
    """(n,) int64 from host ints (n >= 1): a view of an array buffer costs ~3 us, torch.tensor's
    walk of a list ~9 us, and the engine builds several per iteration."""
    t = torch.frombuffer(array.array("q", values), dtype=torch.long)
    return t if device is None or device.type == "cpu" else t.to(device)


def ancestor_matrix(parents: list[int]) -> torch.Tensor:
    """``anc[i, j]`` is True iff node j is node i or one of its ancestors.

    parents: BFS order (parent < child), the root's parent is -1.
    returns: (n, n) bool, built on the host (trees are tens of nodes: bytes viewed as a tensor
    are cheaper than a gather per level).
    """
    n = len(parents)
    anc = bytearray(n * n)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i * n:i * n + p + 1] = anc[p * n:p * n + p + 1]  # a parent's row ends at the parent
        anc[i * n + i] = 1
    return torch.frombuffer(anc, dtype=torch.bool).view(n, n)


def tree_attention_mask(anc: torch.Tensor, prefix_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask for scoring a flattened tree after ``prefix_len`` cached tokens.

    anc: (n, n) bool from :func:`ancestor_matrix`.
    returns: (1, 1, n, prefix_len + n) in ``dtype``: 0 where attention is allowed (the whole
    prefix, and the node's ancestors including itself), the dtype's minimum elsewhere.
    """
    return KeyMask(prefix_len, anc).additive(dtype)


def position_ids(depths: list[int], prefix_len: int) -> torch.Tensor:
    """depths: n node depths -> (1, n) int64 positions ``prefix_len + depth``.

    Omitting these (letting the model number tree nodes 0..n-1 after the prefix) silently
    breaks rotary/learned positions for every node but the first chain.
    """
    return long_tensor([prefix_len + d for d in depths])[None]


def child_index(tokens: list[int], parents: list[int]) -> dict[tuple[int, int], int]:
    """(node, token) -> that node's child carrying the token (siblings carry distinct tokens)."""
    return {(parents[v], tokens[v]): v for v in range(1, len(tokens))}


def accept_path(tokens: list[int], parents: list[int], choice: list[int]) -> tuple[list[int], int]:
    """Longest root-to-node path whose drafted tokens equal the target's greedy choices.

    tokens, parents: the flattened tree; choice[u]: the target's greedy next token after node
    u's path.  Returns (path: node indices from the root down, bonus = choice[path[-1]]).

    A node is *correct* if its token equals the target's choice at its parent; siblings carry
    distinct tokens, so at most one child of a node is correct and the walk down is unique.
    """
    child = child_index(tokens, parents)
    path = [0]
    while (path[-1], choice[path[-1]]) in child:
        path.append(child[(path[-1], choice[path[-1]])])
    return path, choice[path[-1]]
