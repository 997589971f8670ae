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
forward for all such chains) and the others copy it (:func:`prefill_shared`); for the drafts'
caches, rows whose first drafted iteration is the same one (engine.BatchDecoder._draft_prefill).

Memory.  The stored keys/values are capped (``max_bytes``); the least recently used chains go
first, each with its descendants (they are unreachable without it).
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from .native import MAX_PIECES
from .runtime import Seq

BLOCK = 32  # tokens per block: the granularity of sharing
SEEN = 1 << 16  # chain hashes the counting table remembers


class Segment:
    """Consecutive blocks of a chain stored together from one cache: per layer one (heads, n *
    BLOCK, dim) key tensor and one value tensor, which its blocks view.  The native kernel reads a
    shared prefix's keys/values from here rather than from each row's copy (:class:`Shared`), so a
    batch of rows that share it streams it from memory once."""

    __slots__ = ("keys", "values", "nbytes", "live")

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        self.keys, self.values = keys, values
        self.nbytes = sum(k.nbytes + v.nbytes for k, v in zip(keys, values))
        self.live = 0  # stored blocks viewing it


class Shared:
    """A cache's first ``length`` slots as segments hold them (kvcache.BufferCache.shared): in
    ``pieces`` (segment, its first block, blocks), one per run of a chain's blocks that one segment
    holds -- a chain stored in steps (a template, then a prompt that extends it) has several.
    ``own``: whether the cache's own slots hold them too; for the native kernel they need not (it
    reads the segments), and a torch forward first copies them in (:meth:`materialize`)."""

    __slots__ = ("pieces", "length", "own", "_ptrs")

    def __init__(self, pieces: list[tuple[Segment, int, int]], own: bool = True):
        self.pieces, self.own, self._ptrs = pieces, own, None
        self.length = sum(n for _, _, n in pieces) * BLOCK

    def pointers(self):
        """As the C kernel takes them (csrc/neox.c dt_seq): each piece's end slot; per layer, each
        piece's first key (value) address; each piece's segment's head stride."""
        if self._ptrs is None:
            import ctypes

            ends, first, strides = [], 0, []
            for seg, _, n in self.pieces:
                first += n * BLOCK
                ends.append(first)
                strides.append(seg.keys[0].shape[1])

            def starts(which):  # [layer * pieces + piece]: the piece's first slot in every head's rows
                return [(t := getattr(seg, which)[i]).data_ptr() + at * BLOCK * t.shape[-1] * t.element_size()
                        for i in range(len(self.pieces[0][0].keys)) for seg, at, _ in self.pieces]

            ks, vs = starts("keys"), starts("values")
            self._ptrs = ((ctypes.c_long * len(ends))(*ends), (ctypes.c_void_p * len(ks))(*ks),
                          (ctypes.c_void_p * len(vs))(*vs), (ctypes.c_long * len(strides))(*strides))
        return self._ptrs

    def materialize(self, cache) -> None:
        """Copy the shared slots into the cache's own (once)."""
        if not self.own:
            b = 0
            for seg, at, n in self.pieces:
                lo, hi = at * BLOCK, (at + n) * BLOCK
                for layer, k, v in zip(cache.layers, seg.keys, seg.values):
                    layer.keys[0, :, b:b + n * BLOCK] = k[:, lo:hi]
                    layer.values[0, :, b:b + n * BLOCK] = v[:, lo:hi]
                b += n * BLOCK
            self.own = True


class _Node:
    """One block of a stored chain: block ``index`` of ``segment``."""

    __slots__ = ("parent", "tokens", "children", "segment", "index")

    def __init__(self, parent: "_Node | None", tokens: tuple, segment: Segment | None = None, index: int = 0):
        self.parent, self.tokens, self.children, self.segment, self.index = parent, tokens, {}, segment, index


def _runs(path: list[_Node], b: int = 0) -> list[tuple[int, int]]:
    """The runs [b, e) of a chain's blocks from block ``b`` on that one segment holds: they copy
    as one slice, and the kernel reads each as one piece."""
    runs = []
    while b < len(path):
        e = b + 1
        while e < len(path) and path[e].segment is path[b].segment:
            e += 1
        runs.append((b, e))
        b = e
    return runs


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

    def count(self, hashes: list[int], times: int = 1) -> None:
        """``times`` more prompts began with each of these chains."""
        for h in hashes:
            self.seen[h] = self.seen.get(h, 0) + times
            self.seen.move_to_end(h)
        while len(self.seen) > SEEN:
            self.seen.popitem(last=False)

    def times_seen(self, h: int) -> int:
        return self.seen.get(h, 0)

    def copy_into(self, cache, path: list[_Node], lazy: bool = False) -> int:
        """Give an empty ``cache`` a matched chain's keys/values; returns the tokens it now holds.
        ``lazy`` (the native kernel): the slots the cache reads from a segment are not copied."""
        if not path:
            return 0
        n = len(path) * BLOCK
        cache.shared = self.alias(path, own=not lazy)
        b0 = cache.shared.length // BLOCK if lazy else 0  # blocks the cache reads from its own slots
        for i, layer in enumerate(cache.layers):
            k0 = path[0].segment.keys[i]
            layer.reserve(n, k0.shape[0], k0.shape[-1], self.dtype, k0.device)
            for b, e in _runs(path, b0):
                lo, hi = path[b].index * BLOCK, (path[b].index + e - b) * BLOCK
                layer.keys[0, :, b * BLOCK:e * BLOCK] = path[b].segment.keys[i][:, lo:hi]
                layer.values[0, :, b * BLOCK:e * BLOCK] = path[b].segment.values[i][:, lo:hi]
            layer.length = n
        self.reused += n
        return n

    @staticmethod
    def alias(path: list[_Node], own: bool = True) -> Shared | None:
        """A matched chain as a cache's shared slots: its runs of one segment's blocks, as many as
        the kernel reads (native.MAX_PIECES; the cache holds the rest itself)."""
        if not path:
            return None
        return Shared([(path[b].segment, path[b].index, e - b) for b, e in _runs(path)][:MAX_PIECES], own)

    def store(self, cache, tokens: list[int], blocks: int) -> list[_Node]:
        """Store the first ``blocks`` blocks of ``tokens`` from ``cache`` (which holds their keys and
        values at slots 0..), those not stored yet; returns the chain of those blocks."""
        node, self.dtype, path = self.root, cache.layers[0].dtype, []
        for b in range(blocks):
            child = node.children.get(tuple(tokens[b * BLOCK:(b + 1) * BLOCK]))
            if child is None:
                break
            path.append(node := child)
        if len(path) < blocks:  # the new blocks, in one segment
            lo, hi = len(path) * BLOCK, blocks * BLOCK
            if cache.shared is not None and lo < cache.shared.length:
                # a lazy copy left these slots unwritten (the chain was evicted since): fill them
                cache.shared.materialize(cache)
            seg = Segment([l.keys[0, :, lo:hi].clone() for l in cache.layers],
                          [l.values[0, :, lo:hi].clone() for l in cache.layers])
            self.bytes += seg.nbytes
            for i, b in enumerate(range(len(path), blocks)):
                key = tuple(tokens[b * BLOCK:(b + 1) * BLOCK])
                node.children[key] = node = _Node(node, key, seg, i)
                seg.live += 1
                path.append(node)
        for n in path:
            self.lru[n] = None
            self.lru.move_to_end(n)
        self._shrink()
        return path

    def _shrink(self) -> None:
        while self.bytes > self.max_bytes and self.lru:
            self._drop(next(iter(self.lru)))

    def _drop(self, node: _Node) -> None:
        """Forget a block and every block after it in any chain.  Each is unlinked from its parent and
        children, so reference counting frees it (and its segment, with its last block) at once: a
        dropped subtree left as a cycle waited for the cyclic collector, which a service's large heap
        rarely runs -- its RSS grew by every eviction past the cap (the service trial: 1 GB store,
        3.9 GB RSS after 1200 prompts)."""
        todo = [node]
        del node.parent.children[node.tokens]
        while todo:
            n = todo.pop()
            n.segment.live -= 1
            if n.segment.live == 0:  # its memory goes with its last block
                self.bytes -= n.segment.nbytes
            self.lru.pop(n, None)
            todo.extend(n.children.values())
            n.parent, n.children = None, {}

    def clear(self) -> None:
        """Forget every stored block (ModelPair.forget_prefixes)."""
        for child in list(self.root.children.values()):
            self._drop(child)


def prefill_shared(store: PrefixStore | None, runner, items: list[tuple[object, list[int]]],
                   lazy: bool = False) -> tuple[list[int], list[int]]:
    """Before a prefill: fill each empty cache with its tokens' stored prefix, after computing in one
    forward the chains that two or more of these prompts share and nobody stored.  ``items``: (cache,
    tokens to prefill); ``lazy``: the runner is the native kernel (PrefixStore.copy_into).  Returns
    how many tokens each cache holds now (the caller feeds the rest, then calls :func:`remember`),
    and how many of them came from the store."""
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
    held = [store.copy_into(c, p, lazy) for (c, _), p in zip(items, paths)]
    copied = list(held)
    if firsts:
        runner.forward([Seq(torch.tensor(items[i][1][held[i]:s * BLOCK], device=runner.device), items[i][0], keep=1)
                        for i, s in firsts])
        for i, s in firsts:
            chain = store.store(items[i][0], items[i][1], s)
            held[i] = s * BLOCK
            if items[i][0].shared is None:  # (one it has may cover slots it never wrote: it stays)
                items[i][0].shared = store.alias(chain)
        for j, (c, t) in enumerate(items):  # the others copy what the first ones computed
            path = store.match(t)
            if held[j] < len(path) * BLOCK:
                c.shared = None
                c.truncate(0)
                held[j] = copied[j] = store.copy_into(c, path, lazy)
    return held, copied


def remember(store: PrefixStore | None, items: list[tuple[object, list[int]]], again: list[bool] | None = None) -> None:
    """After a prefill: count the chains these prompts began with, and store those now seen twice
    (from the caches, which hold the prompts' keys/values at slots 0..).  ``again[i]``: prompt i
    is known to come back (a job's samples), so it counts as seen twice at once."""
    if store is None:
        return
    for i, (cache, tokens) in enumerate(items):
        hs = chain_hashes(tokens, len(tokens) // BLOCK)
        store.count(hs, 2 if again and again[i] else 1)
        twice = 0
        while twice < len(hs) and store.times_seen(hs[twice]) >= 2:
            twice += 1
        if twice:
            chain = store.store(cache, tokens, twice)
            if cache.shared is None:  # its own slots hold what the store now does: read them from there
                cache.shared = store.alias(chain[:(len(tokens) - 1) // BLOCK])

