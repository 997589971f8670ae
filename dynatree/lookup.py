"""Context lookup: free draft tokens copied from the text so far (prompt lookup decoding).

Why: a small draft model copies poorly from its context, yet greedy generation repeats itself
(names, phrases, and the loops small models fall into).  If the last n committed tokens occurred
before, the tokens that followed that occurrence are a cheap guess at what comes next: no draft
forward, only verification.  The longest match of up to 8 tokens wins: on the bench pair's greedy
outputs an 8-token copy from a 1-8-token match is right for 4.97 / 2.70 tokens on average
(WikiText-2 / Gutenberg) against 4.68 / 2.23 from a 2-4-token match; the draft's top-1 alone is
right at 59% / 69% of positions, a 2-4-gram lookup at 78% / 52% (31% / 16% where the draft is
wrong).

The guess is *grafted* onto the drafted tree as a chain below the root: where it agrees with
drafted nodes it walks down them (no extra verification), where it leaves them it adds nodes.
Verification and acceptance are unchanged, so greedy outputs stay identical to ``ar``; the
target simply scores a few more nodes.  Grafted nodes are marked (``Tree.grafted``) so the draft
calibration and the history adaptation only learn from the draft's own nodes.
"""
from __future__ import annotations

from .tree import Tree, child_index


class NgramIndex:
    """The latest earlier occurrence of every n-gram (min_n <= n <= max_n) of a growing sequence.

    ``last[g]`` is the end index of the latest occurrence of n-gram ``g`` ending at most at
    ``len(seq) - 2``: the current suffix itself is indexed only once a token follows it, so a
    lookup of the suffix finds an *earlier* occurrence, whose next token exists.  Indexing waits
    for the first lookup (a row in a batch where trees do not pay may never look up: indexing a
    500-token prompt costs ~1 ms).
    """

    def __init__(self, tokens: list[int] = (), min_n: int = 1, max_n: int = 8):
        self.min_n, self.max_n = min_n, max_n
        self.seq: list[int] = list(tokens)
        self.last: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # positions whose n-grams are in ``last``: 0 .. indexed - 1

    def extend(self, tokens: list[int]) -> None:
        self.seq.extend(tokens)

    def catch_up(self) -> None:
        """Index the positions that gained a successor since the last lookup: a slice per (end, n),
        ends in order so a later occurrence overwrites (an iteration's few tokens: 4-6 us, against
        16 us for one zip per n; a whole prompt costs about the same either way: 0.2 / 0.6 / 6.6 ms
        for 200 / 500 / 4000 tokens against 0.1 / 0.3 / 8.3 ms)."""
        seq, a, b = self.seq, self.indexed, len(self.seq) - 1  # positions a .. b - 1 gain a successor
        last, lo_n, hi_n = self.last, self.min_n, self.max_n
        for e in range(max(a, lo_n - 1), b):
            for n in range(lo_n, min(hi_n, e + 1) + 1):
                last[tuple(seq[e - n + 1:e + 1])] = e
        self.indexed = max(a, b)

    def propose(self, k: int) -> tuple[list[int], int]:
        """(up to k tokens that followed the latest earlier occurrence of the longest matching
        suffix, that suffix's length n >= min_n); ([], 0) if none occurred.  A copy that runs into
        the present continues from its own output, so a loop of period p yields k tokens, not p."""
        self.catch_up()
        seq, t = self.seq, len(self.seq)
        for n in range(min(self.max_n, t), self.min_n - 1, -1):
            e = self.last.get(tuple(seq[t - n:]))
            if e is not None:
                out: list[int] = []
                for i in range(e + 1, e + 1 + k):
                    out.append(seq[i] if i < t else out[i - t])
                return out, n
        return [], 0


class LookupStats:
    """How often the lookup is right, learned online per cell (match length n, chain index j,
    whether the node was new or one the draft had proposed too): P(chain token j is accepted |
    tokens 0..j-1 were).  A new node is where the lookup disagrees with the draft or goes past
    it, so its cell says what the lookup is worth there.  Optimistic prior, so a gate that starts
    closed can still open; shared by a pair's generations, like the draft calibration."""

    MAX_J = 12

    def __init__(self, prior: tuple[float, float] = (2.0, 1.0)):
        self.prior = prior
        self.cells: dict[tuple[int, int, bool], list[float]] = {}  # -> [hits, tries]

    def _cell(self, n: int, j: int, new: bool) -> list[float]:
        key = (n, min(j, self.MAX_J), new)
        cell = self.cells.get(key)
        if cell is None:
            cell = self.cells[key] = [self.prior[0], self.prior[0] + self.prior[1]]
        return cell

    def value(self, n: int, j: int, new: bool) -> float:
        hits, tries = self._cell(n, j, new)
        return hits / tries

    def values(self, n: int, length: int) -> list[float]:
        """The expected value of each node of a chain of ``length`` new nodes (match length n)."""
        out, v = [], 1.0
        for j in range(length):
            v *= self.value(n, j, True)
            out.append(v)
        return out

    def observe(self, n: int, chain: list[int], new: list[bool], path: list[int]) -> None:
        """chain: the grafted chain's nodes (flattened indices) in order, ``new`` marking the
        nodes graft added; path: the accepted path."""
        on_path = set(path)
        for j, (v, is_new) in enumerate(zip(chain, new)):
            cell = self._cell(n, j, is_new)
            cell[1] += 1
            if v not in on_path:
                return
            cell[0] += 1


def graft(tree: Tree, chain: list[int], n: int = 0, stats: LookupStats | None = None,
          bar: float = 0.0) -> tuple[list[int], list[bool]]:
    """Add ``chain`` (the tokens after the root) as a path below the root, sharing nodes the tree
    already has; new nodes join ``tree.grafted`` (and ``tree.keep`` when set, as do shared nodes
    the budget had left out, so the kept set stays ancestor-closed).

    With ``stats`` (and the chain's match length n), a node is added only while the chain's
    estimated value (the chance that every chain token up to it is accepted) exceeds ``bar``,
    the expected tokens a node must bring to pay for its verification (budget.py; 0 without the
    hardware budget).  Returns the chain's nodes, shared or new, and which of them are new."""
    children = child_index(tree.tokens, tree.parents)
    keep = set(tree.keep) if tree.keep is not None else None
    u, value, nodes, new = 0, 1.0, [], []
    for j, tok in enumerate(chain):
        v = children.get((u, tok))
        fresh = v is None or (keep is not None and v not in keep)  # costs a verification
        value *= stats.value(n, j, fresh) if stats is not None else 1.0
        if fresh and value <= bar:
            break
        if v is None:
            v = tree.add(u, tok, tree.logp[u])  # no draft probability: the path's is carried down
            tree.grafted.add(v)
        if keep is not None:
            keep.add(v)
        nodes.append(v)
        new.append(fresh)
        u = v
    if keep is not None:
        tree.keep = sorted(keep)
    return nodes, new
