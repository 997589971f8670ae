"""The draft model's side of one sequence: a persistent KV cache and level-wise tree expansion.

Invariant between iterations: ``cache`` holds keys/values for the first ``cache.length``
committed tokens and ``pending`` lists the committed tokens after them (it always ends with the
root of the next tree).  The draft is therefore never re-prefilled: each iteration feeds only
``pending`` (typically one or two tokens), then one forward per tree level.

Within an iteration the cache is laid out as::

    [ committed prefix incl. root | nodes expanded at level 1 | level 2 | ... ]
      ^ base = cache length after feeding pending

and each expanded node attends to the prefix plus its own expanded ancestors (a tree mask), so
siblings never see each other's keys/values.  After acceptance, the accepted nodes that were
expanded are moved in place (``keep``) and the rest is dropped.

Greedy drafting proposes each node's top-k tokens.  With a sampler (temperature > 0) it proposes
k draws without replacement from the warped draft distribution instead, reported in draw order
with their draft probabilities, and keeps each expanded node's distribution and draws in
``cands`` for verification (sampling.walk).
"""
from __future__ import annotations

import functools
import time

import torch

from .kvcache import new_cache
from .runtime import KeyMask
from .tree import Tree, long_tensor


def _inference(fn):
    """torch.inference_mode() for calls from outside the engine, and nothing inside it (engine.decode
    runs in inference mode already; entering a context costs ~10 us, a few times per iteration)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)
    return wrapper


class Drafter:
    def __init__(self, model, vocab: int, capacity: int, sampler=None):
        self.model, self.device = model, model.device
        self.sampler = sampler
        self.vocab = vocab
        self.cache = new_cache(model, capacity)
        self.pending: list[int] = []
        self.forwards = 0
        self.fed_tokens = 0  # tokens run through the draft; a re-prefilling drafter would blow this up
        self.seconds = 0.0
        self._reset_tree()

    def _reset_tree(self) -> None:
        self.base = 0
        self.root_pos = 0
        self.slot: dict[int, int] = {}  # tree node -> absolute cache slot
        self.cands: dict[int, tuple[torch.Tensor, list[int]]] = {}  # node -> (q (V,), draws); sampling only
        self.started = False

    def extend(self, tokens: list[int]) -> None:
        """Queue committed tokens (the prompt, then each iteration's commit)."""
        self.pending.extend(tokens)

    def _forward(self, nodes: list[int], k: int, **kwargs) -> tuple[list[list[float]], list[list[int]]]:
        """One draft forward whose kept rows belong to ``nodes`` -> per row k proposals:
        probabilities and token ids (host lists).

        Host sync: the tree's shape depends on these numbers, so they come back once per level.
        Greedy proposals are the forward's own top-k head (fused into the native kernel)."""
        k = min(k, self.vocab)
        if self.sampler is None:
            return self.model(past_key_values=self.cache, use_cache=True, topk=k, cols=self.vocab, **kwargs).top
        logits = self.model(past_key_values=self.cache, use_cache=True, **kwargs).logits[0, :, : self.vocab]
        q = self.sampler.probs(logits)  # (n, V)
        idx = self.sampler.candidates(q, k)  # (n, k) in draw order
        vals, ids = q.gather(-1, idx).tolist(), idx.tolist()
        for r, u in enumerate(nodes):  # draws of probability 0 only pad rows past the support
            n_pos = sum(1 for v in vals[r] if v > 0)
            vals[r], ids[r] = vals[r][:n_pos], ids[r][:n_pos]
            self.cands[u] = (q[r], ids[r])
        return vals, ids

    @_inference
    def root(self, tree: Tree, k: int) -> tuple[list[float], list[int]]:
        """Feed pending committed tokens (ending with the root); top-k of the root's next token."""
        t0 = time.perf_counter()
        self._reset_tree()
        ids = long_tensor(self.pending, self.device)[None]  # (1, p)
        vals, idx = self._forward([0], k, input_ids=ids, logits_to_keep=1)
        self.forwards += 1
        self.fed_tokens += len(self.pending)
        self.pending = []
        self.base = self.cache.length
        self.root_pos = self.base - 1
        self.started = True
        self.seconds += time.perf_counter() - t0
        return vals[0], idx[0]

    @_inference
    def expand(self, tree: Tree, nodes: list[int], k: int) -> tuple[list[list[float]], list[list[int]]]:
        """One draft forward over ``nodes`` (any depths); top-k of each node's next token."""
        t0 = time.perf_counter()
        n = len(nodes)
        dev = self.device
        start, base, slot, parents = self.cache.length, self.base, self.slot, tree.parents
        for r, u in enumerate(nodes):
            slot[u] = start + r
        # keys after the committed prefix: earlier tree levels and these nodes (slots base..start+n-1)
        m = start + n - base
        allowed = bytearray(n * m)  # (n, m) row-major bool
        seen = 0
        for r, u in enumerate(nodes):
            v = u
            while v > 0:  # the node and its ancestors below the root, all expanded already
                allowed[r * m + slot[v] - base] = 1
                seen += 1
                v = parents[v]
        mask = None  # a chain: the one node sees every cached slot, as a plain cached step does
        if not (n == 1 and seen == m):
            mask = KeyMask(base, torch.frombuffer(allowed, dtype=torch.bool).view(n, m).to(dev))  # (n, m)
        ids = long_tensor([tree.tokens[u] for u in nodes], dev)[None]  # (1, n)
        pos = long_tensor([self.root_pos + tree.depths[u] for u in nodes], dev)[None]  # (1, n)
        res = self._forward(nodes, k, input_ids=ids, attention_mask=mask, position_ids=pos)
        self.forwards += 1
        self.fed_tokens += n
        self.seconds += time.perf_counter() - t0
        return res

    @_inference
    def commit(self, path: list[int], committed: list[int]) -> None:
        """Keep the expanded nodes of the accepted ``path`` (node indices from the root) in the cache.

        ``committed`` are this iteration's new tokens: the path's drafted tokens, then the bonus.
        """
        t0 = time.perf_counter()
        if not self.started:
            self.pending.extend(committed)
            return
        fed = []
        for u in path[1:]:
            if u not in self.slot:
                break
            fed.append(self.slot[u])
        self.cache.keep(self.base, fed)
        self.pending = list(committed[len(fed):])
        self._reset_tree()
        self.seconds += time.perf_counter() - t0
