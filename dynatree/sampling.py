"""Temperature sampling and lossless verification of sampled token trees (SpecInfer / DySpec).

Terms (all distributions are after the same temperature / top-k / top-p warping):

* ``p_u``  the target's distribution for the token after node u's path, (V_t,);
* ``q_u``  the draft's distribution there, (V_d,) with V_d <= V_t (missing columns are 0);
* candidates of u: ``x_1 .. x_K``, successive draws from ``q_u`` *without replacement*, so
  ``x_i ~ q_i = norm(q_u with x_1 .. x_{i-1} removed)``;
* residual ``R``: starts at ``p_u``; after ``x_i`` is rejected, ``R <- norm(max(R - q_i, 0))``.

Verification walks down from the root.  At node u the candidates are tried in draw order; x_i is
accepted with probability ``min(1, R(x_i) / q_i(x_i))``.  If some x_i is accepted and it is a
verified tree node, the walk continues below it; if it was drawn but left out of the tree
(pruned, over budget) it is committed as the iteration's last token, since the target has not
scored what follows it.  If every candidate is rejected, or u has none, one token is drawn
from ``R``.  By the speculative-sampling lemma applied once per candidate, the committed token at
every position is distributed exactly as ``p_u`` — whatever the draft proposes, however the tree
was shaped.  This needs two things the code guarantees: every candidate drawn at u is tried
(the tree may keep any subset, chosen by value, without biasing the test), and the tree never
decides whether to keep a node from that node's own descendants.

Every draw is an inverse-CDF lookup (cumsum + searchsorted) driven by one seeded host RNG —
draft candidates, acceptance coins and residual samples alike — so a seed reproduces a
generation exactly, and no draw costs a vocabulary-sized random tensor (``exponential_`` over
8192 entries cost ~0.45 ms here, ``multinomial`` ~0.55 ms; a lookup is a few tens of µs).
"""
from __future__ import annotations

import random

import torch


class Sampler:
    """Warping and seeded draws for one generation.  ``temperature == 0`` never builds one."""

    def __init__(self, temperature: float, top_k: int, top_p: float, seed: int):
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.rng = random.Random(seed)

    @classmethod
    def from_config(cls, cfg) -> "Sampler | None":
        t = getattr(cfg, "temperature", 0.0)
        return cls(t, cfg.top_k, cfg.top_p, cfg.seed) if t > 0 else None

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: (n, V) -> (n, V) probabilities (float32, or float64 for float64 models)."""
        x = logits if logits.dtype == torch.float64 else logits.float()
        x = x / self.temperature
        if 0 < self.top_k < x.shape[-1]:
            kth = x.topk(self.top_k, dim=-1).values[:, -1:]  # (n, 1)
            x = x.masked_fill(x < kth, -torch.inf)
        if self.top_p < 1.0:
            srt, idx = x.sort(dim=-1, descending=True)
            sp = srt.softmax(-1)
            drop = sp.cumsum(-1) - sp >= self.top_p  # the mass before this token already reaches top_p
            x = x.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), -torch.inf)
        return x.softmax(-1)

    def uniform(self) -> float:
        """One U(0, 1) coin."""
        return self.rng.random()

    def _lookup(self, probs: torch.Tensor) -> torch.Tensor:
        """probs: (n, V) unnormalised, nonnegative -> (n,) one draw per row."""
        cdf = probs.cumsum(-1)  # (n, V)
        u = torch.tensor([[self.rng.random()] for _ in range(probs.shape[0])], dtype=cdf.dtype,
                         device=cdf.device)  # (n, 1)
        idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)  # first entry whose cdf exceeds u
        return idx.clamp_(max=probs.shape[-1] - 1).squeeze(1)

    def sample(self, probs: torch.Tensor) -> int:
        """probs: (V,) -> one token id.  Host sync."""
        return int(self._lookup(probs[None])[0])

    def candidates(self, q: torch.Tensor, k: int) -> torch.Tensor:
        """q: (n, V) -> (n, k) token ids, each row k draws without replacement in draw order.

        Tokens with q = 0 come last in a row when k exceeds the support; callers drop them.
        """
        q = q.clone()
        out = []
        for _ in range(min(k, q.shape[-1])):
            x = self._lookup(q)  # (n,)
            out.append(x)
            q.scatter_(1, x[:, None], 0.0)
        return torch.stack(out, dim=1)


def accept_prob(r_x: float, q_x: float) -> float:
    """min(1, R(x) / q_i(x)): the speculative-sampling acceptance rule (a seam for tests)."""
    return 1.0 if r_x >= q_x else r_x / q_x


def walk(p: torch.Tensor, cands: dict[int, tuple[torch.Tensor, list[int]]],
         children: dict[tuple[int, int], int], sampler: Sampler,
         copies: dict[int, int] | None = None) -> tuple[list[int], int]:
    """Multi-candidate rejection sampling down a scored tree.

    p: (n, V_t) target probabilities at the flattened tree's nodes.
    cands: node -> (q_u (V_d,), candidate ids in draw order) for nodes the draft expanded.
    children: (node, token) -> child node, for the tree's verified nodes.
    copies: node -> a context-lookup token proposed there (lookup.py), tried before the draws as a
    candidate from a point mass: accepted with probability R(t) = min(1, R(t) / 1); if rejected,
    R becomes norm(max(R - delta_t, 0)), i.e. R without t.  The copy is a deterministic function
    of the committed text, so it is as valid a proposal as a draw.
    returns (path of nodes from the root, last token): the committed tokens are the path's
    drafted tokens followed by ``last``.
    """
    u, path = 0, [0]
    copies = copies or {}
    while True:
        r = p[u]
        q0, xs = cands.get(u, (None, []))
        accepted, q = None, None
        copy = copies.get(u)
        if copy is not None:
            r_t = float(r[copy])  # host sync: one per copied token tried
            if sampler.uniform() < r_t:
                accepted = copy
                xs = []
            elif r_t < 1.0:
                r = r.clone()
                r[copy] = 0
                r = r / (1.0 - r_t)
        if xs:
            # One transfer per node: the draws' draft and target probabilities.  While no draw is
            # rejected, q_i(x_i) = q(x_i) / (1 - mass of earlier draws) and R is unchanged, so an accepted
            # first draw (the common case) costs no vector work at all.
            idx = torch.tensor(xs, device=r.device)
            q_xs, r_xs = torch.stack([q0[idx].to(r.dtype), r[idx]]).tolist()  # host sync: one per node
            removed = 0.0
            for i, x in enumerate(xs):
                left = 1.0 - removed
                if left <= 1e-12:
                    break  # the draft's support is used up
                q_x = q_xs[i] / left
                r_x = r_xs[i] if q is None else float(r[x])  # host sync after a rejection
                if sampler.uniform() < accept_prob(r_x, q_x):
                    accepted = x
                    break
                if q is None:
                    q = torch.zeros_like(r)
                    q[: q0.shape[0]] = q0.to(r.dtype)
                    q[idx[:i]] = 0  # draws before this one
                res = (r - q / left).clamp_(min=0)
                mass = float(res.sum())
                if mass > 1e-12:  # p == q_i would make rejection impossible; guard the rounding
                    r = res / mass
                q[x] = 0
                removed += q_xs[i]
        if accepted is None:
            return path, sampler.sample(r)
        child = children.get((u, accepted))
        if child is None:
            return path, accepted
        path.append(child)
        u = child
