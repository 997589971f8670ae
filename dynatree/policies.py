"""Drafting policies: how each method grows its tree.  The decoding loop is shared (engine.py).

A policy has ``attach(pair)`` (once per generation), ``grow(drafter, root_token, max_depth,
hint)`` -- a generator that yields the draft forwards it needs and returns the Tree, so the engine
packs many sequences' levels into one forward (drafting.drive); ``draft(...)`` grows one alone --
and ``observe(accepted, tree, path)`` (after each verification).  ``hint`` lists
the expected values of the context-lookup nodes the engine will graft (lookup.py); the hardware
budget counts them when it prices the tree, the other policies ignore it.  ``max_depth`` is the
engine's cap (tokens left before ``max_new_tokens`` or the context limit); policies never draft
deeper.

Three of the four tree methods are the same level-wise growth (:func:`grow_levels`) with
different rules for which nodes expand and how many children they get:

* ``linear``      one child per level, k levels;
* ``fixed_tree``  B children per node to depth D, prune path probability < tau, budget N_max;
* ``dynatree``    B(u) from draft confidence, rho_stop/rho_deep depth gating, pruning, budget,
                  and history adaptation of D_0 and tau_h;
* ``dyspec``      threshold mode is level-wise growth over a value threshold; heap mode grows
                  best-first by estimated acceptance value (:class:`DySpecHeap`).

Tree depth here counts *drafted* tokens: the root is the last committed token, so the first
drafted level already branches (the paper's single draft root u0 is our depth-1 level).
Pruned nodes (path probability < tau) are not added to the tree at all, so they cost no
verification.
"""
from __future__ import annotations

import heapq
import math
import time
from collections import deque

from .config import (ARConfig, DynaTreeConfig, DySpecConfig, FixedTreeConfig, LinearConfig)
from . import budget
from .drafting import Drafter, run
from .tree import Tree


def _log(p: float) -> float:
    return math.log(p) if p > 0 else -math.inf


def _best(cands: list[tuple], room: int) -> list[tuple]:
    """The ``room`` highest-scoring candidates (score first in each tuple), in their original order."""
    if len(cands) <= room:
        return cands
    keep = sorted(range(len(cands)), key=lambda i: -cands[i][0])[:room]
    return [cands[i] for i in sorted(keep)]


def grow_levels(drafter: Drafter, root_token: int, *, max_depth: int, max_nodes: int, kmax: int,
                n_children, expandable, min_logp: float) -> Tree:
    """Grow a tree one level per draft forward.

    n_children(node, confidence) -> int: children to add below an expanded node.
    expandable(tree, node) -> bool: whether a freshly added node gets expanded next level.
    min_logp: children with path log-probability below this are pruned (never added).
    When the budget binds, the level's most probable candidates win.
    """
    tree = Tree.root_only(root_token)
    if max_depth <= 0 or max_nodes <= 0:
        return tree
    probs, ids = yield from drafter.root(kmax)
    frontier, dists = [0], [(probs, ids)]
    while True:
        cands = []  # (logp, parent, token, rank) in parent/rank order
        for u, (p, t) in zip(frontier, dists):
            for r in range(min(n_children(u, p[0]), len(p))):
                lp = tree.logp[u] + _log(p[r])
                if lp >= min_logp:
                    cands.append((lp, u, t[r], r))
        cands = _best(cands, max_nodes - (len(tree) - 1))
        new = [tree.add(u, tok, lp, r) for lp, u, tok, r in cands]
        if not new or len(tree) - 1 >= max_nodes or tree.depths[new[0]] >= max_depth:
            return tree
        frontier = [v for v in new if expandable(tree, v)]
        if not frontier:
            return tree
        dists = list(zip(*(yield from drafter.expand(tree, frontier, kmax))))


def grow_budgeted(drafter: Drafter, root_token: int, *, max_depth: int, max_nodes: int, kmax: int,
                  n_children, gate, tau: float, lat: budget.LatencyModel,
                  calib: budget.Calibration, hint=(), held: list | None = None) -> Tree:
    """:func:`grow_levels` under the hardware-aware budget (rules in budget.py).

    DynaTree's rules run on *calibrated* probabilities: confidence is the calibrated chance the
    top-1 child is accepted, and the depth gates gate(depth, value) and pruning (value < tau)
    use the calibrated path value, so thresholds carry over between pairs whose drafts are
    calibrated differently.  Sets ``tree.keep`` to the nodes worth verifying; drafting stops
    when another level cannot pay for its draft time.  Each drafted node is held in the
    calibration (Calibration.hold) until the caller releases ``held``, after verification.
    """
    t0 = drafter.seconds
    tree = Tree.root_only(root_token)
    if max_depth <= 0 or max_nodes <= 0:
        return tree
    lat.relax()
    clock = [time.perf_counter()]

    def lap(width: int) -> None:
        """A level's real cost: its forward plus this loop's bookkeeping since the last lap."""
        now = time.perf_counter()
        lat.observe_draft(width, (now - clock[0]) * 1e3)
        clock[0] = now

    probs, ids = yield from drafter.root(kmax)
    lap(1)
    frontier, dists, vals = [0], [(probs, ids)], [1.0]
    a_top = calib.top1()
    while True:
        cands = []
        for u, (p, t) in zip(frontier, dists):
            for r in range(min(n_children(u, calib(p[0])), len(p))):
                value = vals[u] * calib(p[r], r)
                if value >= tau:
                    cands.append((value, tree.logp[u] + _log(p[r]), u, t[r], p[r], r))
        cands = _best(cands, max_nodes - (len(tree) - 1))
        new = []
        for v, lp, u, tok, q, r in cands:
            new.append(tree.add(u, tok, lp, r))
            vals.append(v)
            if held is not None:
                held.append(calib.hold(q, r))
        ranked = sorted(range(1, len(tree)), key=lambda i: (-vals[i], tree.depths[i], i))
        # the lookup nodes to come compete for the same verification time, so they set the rate too
        priced = sorted([vals[i] for i in ranked] + list(hint), reverse=True) if hint else [vals[i] for i in ranked]
        n_all, rate, delta = budget.select(priced, lat, lat.spent((drafter.seconds - t0) * 1e3))
        cut = priced[n_all - 1] if n_all else math.inf
        k = sum(1 for i in ranked if vals[i] >= cut) if hint else n_all  # drafted nodes that made the cut
        bar = rate * delta  # a node must bring more than this many expected tokens
        if not new or len(tree) - 1 >= max_nodes or tree.depths[new[0]] >= max_depth:
            break
        frontier = [v for v in new if gate(tree.depths[v], vals[v]) and vals[v] * a_top > bar]
        if not frontier or not budget.worth_drafting([vals[v] for v in frontier], a_top, rate, lat, n_all + 1):
            break
        dists = list(zip(*(yield from drafter.expand(tree, frontier, kmax))))
        lap(len(frontier))
    tree.keep = [0] + sorted(ranked[:k])
    tree.bar = bar
    return tree


# What a tree's nodes are priced against (budget.Latency.view): the batch's other rows' tokens,
# its rows, the Governor's scale and this row's cache length (None: the profile's).
ALONE = (0, 1, 1.0, None)


class NoDraft:
    """``ar``: the tree is just the root, so each iteration is one plain target step."""

    needs_draft = False

    def attach(self, pair) -> None:
        """Called once per generation with the pair (policies that measure the device use it)."""

    def draft(self, drafter, root_token: int, max_depth: int, hint=()) -> Tree:
        """Grow one sequence's tree alone."""
        return run(drafter, self.grow(drafter, root_token, max_depth, hint))

    def grow(self, drafter, root_token: int, max_depth: int, hint=(), batch=ALONE):
        """A generator that yields the draft forwards it needs (drafting.DraftCall) and returns the
        tree, so that drafting.drive can pack several sequences' levels into one forward."""
        return Tree.root_only(root_token)
        yield  # drafts nothing

    def observe(self, accepted: int, tree: Tree, path: list[int]) -> None:
        pass

    def observe_verify(self, n_tokens: int, seconds: float, cached: int | None = None) -> None:
        """Wall time of one verification (forward, accept, commit) over ``n_tokens`` tree tokens
        on a cache of ``cached`` tokens."""

    def observe_overhead(self, seconds: float) -> None:
        """Wall time of one iteration (the whole batch's) outside its draft levels and its
        verification."""


class Linear(NoDraft):
    needs_draft = True

    def __init__(self, cfg: LinearConfig):
        self.cfg = cfg

    def grow(self, drafter, root_token, max_depth, hint=(), batch=ALONE):
        k = min(self.cfg.k, max_depth)
        return grow_levels(drafter, root_token, max_depth=k, max_nodes=k, kmax=1,
                           n_children=lambda u, c: 1, expandable=lambda t, v: True,
                           min_logp=-math.inf)


class DynaTree(NoDraft):
    """DynaTree; with all three mechanisms off it is exactly the fixed tree (depth d0, b_mid)."""

    needs_draft = True

    def __init__(self, cfg: DynaTreeConfig):
        self.cfg = cfg
        self.d0 = cfg.d0
        self.tau_h = cfg.tau_h
        self.window: deque[float] = deque(maxlen=cfg.window)
        self.calib = self.latency = None
        self.held: list[tuple[int, int]] = []  # calibration cells of the last tree's nodes (Calibration.hold)

    def attach(self, pair) -> None:
        """Hardware budget: profile the device once per pair and share the calibration."""
        if self.cfg.budget_on:
            self.latency = budget.profile(pair, kv_dtype=self.cfg.kv_dtype)
            self.calib = pair.learned(("calibration", *self.cfg.sampling_key), budget.Calibration)

    def observe_verify(self, n_tokens: int, seconds: float, cached: int | None = None) -> None:
        if self.latency is not None:
            self.latency.observe_verify(n_tokens, seconds * 1e3, cached)

    def observe_overhead(self, seconds: float) -> None:
        if self.latency is not None:
            self.latency.observe_overhead(seconds * 1e3)

    def _branching(self, u: int, conf: float) -> int:
        c = self.cfg
        if not c.dynamic_breadth:
            return c.b_mid
        if conf >= self.tau_h:
            return c.b_min
        if conf < c.tau_l:
            return c.b_max
        return c.b_mid

    def _expandable(self, tree: Tree, v: int) -> bool:
        return self._gate(tree.depths[v], math.exp(tree.logp[v]))

    def _gate(self, d: int, p: float) -> bool:
        """Depth gating on a node at depth d with path probability p."""
        if not self.cfg.dynamic_depth:
            return d < self.d0
        c = self.cfg
        return d < c.d_max and p >= c.rho_stop and (d < self.d0 or p >= c.rho_deep)

    def grow(self, drafter, root_token, max_depth, hint=(), batch=ALONE):
        c = self.cfg
        depth_cap = c.d_max if c.dynamic_depth else self.d0
        if self.latency is not None:
            self._release()
            return grow_budgeted(drafter, root_token, max_depth=min(depth_cap, max_depth),
                                 max_nodes=c.max_nodes, kmax=c.b_max if c.dynamic_breadth else c.b_mid,
                                 n_children=self._branching, gate=self._gate, tau=c.tau,
                                 lat=self.latency.view(*batch), calib=self.calib, hint=hint,
                                 held=self.held)
        return grow_levels(drafter, root_token, max_depth=min(depth_cap, max_depth),
                           max_nodes=c.max_nodes, kmax=c.b_max if c.dynamic_breadth else c.b_mid,
                           n_children=self._branching, expandable=self._expandable,
                           min_logp=_log(c.tau))

    def _release(self) -> None:
        if self.held:
            self.calib.release(self.held)
            self.held = []

    def observe(self, accepted: int, tree: Tree, path: list[int]) -> None:
        """History adaptation (and, with the hardware budget, calibration).

        a_r = accepted drafted tokens / depth of the tree (the fraction of the deepest drafted
        path that was committed).  Once W values are in the window, its mean ``a`` moves the
        configuration one step: ``a >= hist_high`` -> D_0 += 1 and tau_h -= 0.05 (deeper, and
        more nodes count as confident so get b_min children, spending the budget on depth);
        ``a <= hist_low`` -> D_0 -= 1 and tau_h += 0.05.  D_0 stays within base±2 and below
        D_max, tau_h within [tau_l + 0.05, 0.99].  The window is cleared after each step so the
        next decision looks at W iterations under the new setting.
        """
        c = self.cfg
        grafted = tree.grafted  # lookup nodes: the draft proposed none of them, so they teach nothing here
        if self.calib is not None:
            self._release()
        if self.calib is not None and len(tree) > 1:
            # Each tested node (its parent accepted) teaches the cell it was priced in: its draft
            # probability and its rank among the draft's proposals -- not its place among the
            # kept siblings, which differ once the budget keeps a later proposal without an
            # earlier one (a rank never tested keeps its optimistic prior and looks best forever).
            on_path = set(path)
            for u in range(1, len(tree)):
                parent = tree.parents[u]
                # below a node the draft gave probability 0 (a sharp temperature underflows it)
                # the path's log-probability is -inf and a child's own q is lost
                if parent in on_path and u not in grafted and tree.logp[parent] > -math.inf:
                    self.calib.update(math.exp(tree.logp[u] - tree.logp[parent]), u in on_path,
                                      rank=tree.ranks[u])
        if grafted:
            depth = max((d for u, d in enumerate(tree.depths) if u not in grafted), default=0)
            accepted = sum(1 for u in path[1:] if u not in grafted)
        else:
            depth = tree.max_depth
        if not c.history or depth == 0:
            return
        self.window.append(min(accepted, depth) / depth)
        if len(self.window) < c.window:
            return
        a = sum(self.window) / len(self.window)
        lo_d, hi_d = max(1, c.d0 - 2), min(c.d_max - 1, c.d0 + 2)
        if a >= c.hist_high:
            self.d0 = min(self.d0 + 1, hi_d)
            self.tau_h = max(round(self.tau_h - 0.05, 4), c.tau_l + 0.05)
        elif a <= c.hist_low:
            self.d0 = max(self.d0 - 1, lo_d)
            self.tau_h = min(round(self.tau_h + 0.05, 4), 0.99)
        else:
            return
        self.window.clear()


def fixed_tree(cfg: FixedTreeConfig) -> DynaTree:
    """The textbook fixed tree: no hardware budget either (it would prune and stop the tree)."""
    return DynaTree(DynaTreeConfig(
        d0=cfg.depth, d_max=cfg.depth + 1, b_min=cfg.branch, b_mid=cfg.branch, b_max=cfg.branch,
        tau=cfg.tau, max_nodes=cfg.max_nodes, dynamic_breadth=False, dynamic_depth=False,
        history=False, hw_budget="off", kv_update=cfg.kv_update, lookup=cfg.lookup))


class DySpecThreshold(NoDraft):
    """DySpec Algorithm 2: layer by layer, add every child whose estimated value >= threshold.

    In greedy decoding a node's children are its draft top-k in order; the i-th child's value
    is value(parent) x P(earlier siblings rejected) x q_residual(x_i), which equals
    value(parent) x q(x_i), i.e. the draft probability of the path.
    """

    needs_draft = True

    def __init__(self, cfg: DySpecConfig):
        self.cfg = cfg

    def grow(self, drafter, root_token, max_depth, hint=(), batch=ALONE):
        c = self.cfg
        return grow_levels(drafter, root_token, max_depth=min(c.max_depth, max_depth),
                           max_nodes=c.budget, kmax=c.max_branch,
                           n_children=lambda u, conf: c.max_branch,
                           expandable=lambda t, v: True, min_logp=_log(c.threshold))


class DySpecHeap(NoDraft):
    """DySpec Algorithm 1: repeatedly add the candidate with the highest estimated value.

    Candidates are "the r-th child of node u"; adding one pushes its next sibling and its first
    child.  A first child's value needs the draft distribution at the new node, which costs a
    draft forward, so such candidates enter the heap *unresolved* with the upper bound
    value(u) (a child can never beat its parent).  Popping an unresolved candidate runs one
    draft forward over every unresolved node at once and pushes the exact values back: the tree
    is the same as strictly sequential greedy expansion, with fewer draft calls.
    """

    needs_draft = True

    def __init__(self, cfg: DySpecConfig):
        self.cfg = cfg

    def grow(self, drafter, root_token, max_depth, hint=(), batch=ALONE):
        c = self.cfg
        tree = Tree.root_only(root_token)
        max_depth = min(c.max_depth, max_depth)
        if max_depth <= 0 or c.budget <= 0:
            return tree
        k = c.max_branch
        dist: dict[int, tuple[list[float], list[int]]] = {0: (yield from drafter.root(k))}
        heap: list = []  # (-value, seq, parent, rank, resolved)
        seq = 0

        def push(neg_value, parent, rank, resolved):
            nonlocal seq
            heapq.heappush(heap, (neg_value, seq, parent, rank, resolved))
            seq += 1

        push(-dist[0][0][0], 0, 0, True)
        unresolved: list[int] = []
        while heap and len(tree) - 1 < c.budget:
            neg, _, u, r, resolved = heapq.heappop(heap)
            if not resolved:
                batch = [v for v in unresolved if v not in dist]
                if batch:
                    for v, p, t in zip(batch, *(yield from drafter.expand(tree, batch, k))):
                        dist[v] = (p, t)
                unresolved = []
                push(-math.exp(tree.logp[u]) * dist[u][0][0], u, 0, True)
                continue
            probs, toks = dist[u]
            v = tree.add(u, toks[r], tree.logp[u] + _log(probs[r]), r)
            if r + 1 < len(probs):
                push(-math.exp(tree.logp[u]) * probs[r + 1], u, r + 1, True)
            if tree.depths[v] < max_depth:
                unresolved.append(v)
                push(-math.exp(tree.logp[v]), v, 0, False)
        return tree


def make_policy(cfg):
    if isinstance(cfg, ARConfig):
        return NoDraft()
    if isinstance(cfg, LinearConfig):
        return Linear(cfg)
    if isinstance(cfg, FixedTreeConfig):
        return fixed_tree(cfg)
    if isinstance(cfg, DynaTreeConfig):
        return DynaTree(cfg)
    if isinstance(cfg, DySpecConfig):
        return DySpecThreshold(cfg) if cfg.mode == "threshold" else DySpecHeap(cfg)
    raise TypeError(f"no drafting policy for {type(cfg).__name__}")
