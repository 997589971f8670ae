"""Prefix caching: prompts that begin alike compute their common beginning once.

Corpus jobs often render every prompt from one template (a system prompt, few-shot examples, an
instruction header).  A token's keys and values depend only on the tokens up to it (causal
attention, positions from 0), so a prefix computed for one prompt serves every prompt that starts
with it: its keys/values are copied into the new row's cache and only the rest is prefilled.  On
the native kernel the copied keys/values are the very bits the row's own prefill would write
(batch invariance; chunked prefill has the same property), so sharing changes no output; on torch
paths a prefill in two pieces rounds like any other batching change.

Blocks.  Prompts are cut into blocks of ``BLOCK`` tokens; a stored prefix is a chain of whole
blocks, kept in a trie keyed by each block's tokens (matching compares tokens, never hashes).  A
prompt reuses the longest stored chain that leaves its last token to compute (its logits give the
first new token).

What is stored.  A chain is stored once two prompts have started with it: a bounded table of chain
hashes counts how many prompts began with each (a hash collision can only waste a store, never
share wrong keys), so a corpus whose prompts never repeat pays for the hashing alone.  When
several prompts that join together share a chain nobody stored, one of them computes it first (one
forward for all such chains) and the others copy it (:func:`prefill_shared`).

Memory.  The stored keys/values are capped (``max_bytes``); the least recently used chains go
first, each with its descendants (they are unreachable without it).
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from .runtime import Seq

BLOCK = 32  # tokens per block: the granularity of sharing
SEEN = 1 << 16  # chain hashes the counting table remembers


class _Node:
    """One block of a stored chain: its tokens' keys and values, per layer ((heads, BLOCK, dim) each)."""

    __slots__ = ("parent", "tokens", "children", "kv", "nbytes")

    def __init__(self, parent: "_Node | None", tokens: tuple, kv: list | None):
        self.parent, self.tokens, self.children, self.kv = parent, tokens, {}, kv
        self.nbytes = sum(k.nbytes + v.nbytes for k, v in kv) if kv else 0


def chain_hashes(tokens: list[int], blocks: int) -> list[int]:
    """The hash of each of the first ``blocks`` whole blocks together with every block before it."""
    out, h = [], 0
    for b in range(blocks):
        h = hash((h, tuple(tokens[b * BLOCK:(b + 1) * BLOCK])))
        out.append(h)
    return out


class PrefixStore:
    """Stored prefix chains of one model's caches (one store per model and cache dtype)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self.root = _Node(None, (), None)
        self.lru: OrderedDict[_Node, None] = OrderedDict()  # stored blocks, least recently used first
        self.bytes = 0
        self.dtype = None  # the dtype the caches compute in (their layers' ``dtype``)
        self.seen: OrderedDict[int, int] = OrderedDict()  # chain hash -> prompts that began with it
        self.reused = 0  # tokens copied out instead of computed (all rows)

    def match(self, tokens: list[int]) -> list[_Node]:
        """The longest stored chain ``tokens`` starts with, leaving its last token to compute."""
        node, path = self.root, []
        for b in range((len(tokens) - 1) // BLOCK):
            node = node.children.get(tuple(tokens[b * BLOCK:(b + 1) * BLOCK]))
            if node is None:
                break
            path.append(node)
        for n in path:  # parents first: a chain's tail is always its most recently used block
            self.lru.move_to_end(n)
        return path

    def count(self, hashes: list[int]) -> None:
        """One more prompt began with each of these chains."""
        for h in hashes:
            self.seen[h] = self.seen.get(h, 0) + 1
            self.seen.move_to_end(h)
        while len(self.seen) > SEEN:
            self.seen.popitem(last=False)

    def times_seen(self, h: int) -> int:
        return self.seen.get(h, 0)

    def copy_into(self, cache, path: list[_Node]) -> int:
        """Write a matched chain's keys/values into an empty ``cache``; returns the tokens written."""
        if not path:
            return 0
        n = len(path) * BLOCK
        for i, layer in enumerate(cache.layers):
            k0 = path[0].kv[i][0]
            layer.reserve(n, k0.shape[0], k0.shape[-1], self.dtype, k0.device)
            for b, node in enumerate(path):
                k, v = node.kv[i]
                layer.keys[0, :, b * BLOCK:(b + 1) * BLOCK] = k
                layer.values[0, :, b * BLOCK:(b + 1) * BLOCK] = v
            layer.length = n
        self.reused += n
        return n

    def store(self, cache, tokens: list[int], blocks: int) -> None:
        """Store the first ``blocks`` blocks of ``tokens`` from ``cache`` (which holds their keys and
        values at slots 0..), those not stored yet."""
        node, self.dtype = self.root, cache.layers[0].dtype
        for b in range(blocks):
            key = tuple(tokens[b * BLOCK:(b + 1) * BLOCK])
            child = node.children.get(key)
            if child is None:
                lo, hi = b * BLOCK, (b + 1) * BLOCK
                kv = [(l.keys[0, :, lo:hi].clone(), l.values[0, :, lo:hi].clone()) for l in cache.layers]
                child = node.children[key] = _Node(node, key, kv)
                self.bytes += child.nbytes
            self.lru[child] = None
            self.lru.move_to_end(child)
            node = child
        self._shrink()

    def _shrink(self) -> None:
        while self.bytes > self.max_bytes and self.lru:
            self._drop(next(iter(self.lru)))

    def _drop(self, node: _Node) -> None:
        """Forget a block and every block after it in any chain."""
        todo = [node]
        del node.parent.children[node.tokens]
        while todo:
            n = todo.pop()
            self.bytes -= n.nbytes
            self.lru.pop(n, None)
            todo.extend(n.children.values())


def prefill_shared(store: PrefixStore | None, runner, items: list[tuple[object, list[int]]]) -> list[int]:
    """Before a prefill: fill each empty cache with its tokens' stored prefix, after computing in one
    forward the chains that two or more of these prompts share and nobody stored.  ``items``: (cache,
    tokens to prefill).  Returns how many tokens each cache holds now (the caller feeds the rest, then
    calls :func:`remember`), and how many of them were copied from the store."""
    if store is None:
        return [0] * len(items), [0] * len(items)
    usable = [(len(t) - 1) // BLOCK for _, t in items]
    hashes = [chain_hashes(t, u) for (_, t), u in zip(items, usable)]
    paths = [store.match(t) for _, t in items]
    here: dict[int, int] = {}  # chain hash -> prompts of this group starting with it
    for hs in hashes:
        for h in hs:
            here[h] = here.get(h, 0) + 1
    firsts, covered = [], set()  # one prompt computes each shared chain for the group
    for i in sorted(range(len(items)), key=lambda i: -len(hashes[i])):
        s = next((b for b in range(len(hashes[i]), len(paths[i]), -1) if here[hashes[i][b - 1]] >= 2), 0)
        if s and hashes[i][s - 1] not in covered:
            firsts.append((i, s))
            covered.update(hashes[i][:s])
    held = [store.copy_into(c, p) for (c, _), p in zip(items, paths)]
    copied = list(held)
    if firsts:
        runner.forward([Seq(torch.tensor(items[i][1][held[i]:s * BLOCK], device=runner.device), items[i][0], keep=1)
                        for i, s in firsts])
        for i, s in firsts:
            store.store(items[i][0], items[i][1], s)
            held[i] = s * BLOCK
        for j, (c, t) in enumerate(items):  # the others copy what the first ones computed
            if held[j] < len(store.match(t)) * BLOCK:
                c.truncate(0)
                held[j] = copied[j] = store.copy_into(c, store.match(t))
    return held, copied


def remember(store: PrefixStore | None, items: list[tuple[object, list[int]]]) -> None:
    """After a prefill: count the chains these prompts began with, and store those now seen twice
    (from the caches, which hold the prompts' keys/values at slots 0..)."""
    if store is None:
        return
    for cache, tokens in items:
        hs = chain_hashes(tokens, len(tokens) // BLOCK)
        store.count(hs)
        twice = 0
        while twice < len(hs) and store.times_seen(hs[twice]) >= 2:
            twice += 1
        if twice:
            store.store(cache, tokens, twice)

