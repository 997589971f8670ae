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
the top-k of the draft's perturbed scores instead, with the noise of the index each node
predicts (sampling.Sampler.propose), so the target's seeded draw is likely among them.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from .kvcache import new_cache
from .runtime import KeyMask, Seq
from .sampling import head, in_head, propose_each
from .tree import Tree, long_tensor


def _inference(fn):
    """torch.inference_mode() for calls from outside the engine, and nothing inside it (BatchDecoder.step
    runs in inference mode already; entering a context costs ~10 us, a few times per iteration)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)
    return wrapper


@dataclass
class DraftCall:
    """One draft forward a drafter asks for: its sequence's new rows, the top-k it reads, and the
    depths of the rows it reads them from (a sampler's noise is per depth)."""

    seq: Seq
    k: int  # 0: no proposals read (a prefill)
    depths: tuple | list = (0,)


class DraftVocabError(ValueError):
    """A committed token the draft has no embedding for (a target vocabulary wider than its
    draft's, e.g. padded): the engine goes on without drafts for that row (_Row.retire_drafter)."""


class Drafter:
    """A sequence's draft state.  ``root`` and ``expand`` are generators: each yields one
    :class:`DraftCall` and receives its runtime.Output, so several sequences' levels can share one
    packed draft forward (:func:`drive`); :func:`run` drives one sequence alone."""

    def __init__(self, model, vocab: int, capacity: int, sampler=None, window=None, kv_dtype: str = "model",
                 context: int = 0, positions: int = 0):
        self.model, self.device = model, model.device
        self.sampler = sampler
        self.window = window  # kvcache.Window (StreamingLLM) or None
        self.context = context  # config.SpecConfig.draft_context: 0, or the most tokens a (re)start feeds
        # the draft's own positions where the text may outgrow them (a draft with a shorter context than
        # its target: ModelPair.draft_positions), else 0.  The draft then restarts on the text's latest
        # tokens before a root would leave a tree less than a quarter of them: its positions count from
        # the restart, so they stay inside its table while the target reads the whole text.
        self.positions = positions
        self.text: list[int] = []  # with positions: the committed tokens in the cache, in order (the latest)
        self.restarts = 0
        self.vocab = vocab
        self.cache = new_cache(model, capacity, kv_dtype)
        self.pending: list[int] = []
        self.forwards = 0
        self.fed_tokens = 0  # tokens run through the draft; a re-prefilling drafter would blow this up
        self.seconds = 0.0  # wall time of the draft forwards (and tree growth) this sequence waited for
        self._reset_tree()

    def _reset_tree(self) -> None:
        self.base = 0
        self.root_pos = 0
        self.slot: dict[int, int] = {}  # tree node -> absolute cache slot
        self.started = False

    def extend(self, tokens: list[int]) -> None:
        """Queue committed tokens (the prompt, then each iteration's commit)."""
        self._in_vocab(tokens)
        self.pending.extend(tokens)

    def _in_vocab(self, tokens: list[int]) -> None:
        """A target wider than its draft may choose an id the draft cannot embed: caught here (on
        a GPU the embedding lookup would be a device-side assert that ends the process)."""
        if tokens and max(tokens) >= self.vocab:
            raise DraftVocabError(f"token id {max(tokens)} is outside the draft's vocabulary ({self.vocab} tokens)")

    def _feed(self, tokens: list[int], k: int = 0, perturb=None):
        """One draft forward over committed ``tokens`` into the cache (the Output's top-k of the
        last one, ``k``; 0 for none).  A generator (see the class); returns the Output."""
        out = yield DraftCall(Seq(long_tensor(tokens, self.device), self.cache, keep=1, perturb=perturb), k)
        self.forwards += 1
        self.fed_tokens += len(tokens)
        self._cached(tokens)
        return out

    def _cached(self, tokens: list[int]) -> None:
        """Committed ``tokens`` now in the cache: the text a restart within the positions reads."""
        if self.positions:
            self.text += tokens
            if len(self.text) > 2 * self.positions:  # (a restart reads at most half of them)
                del self.text[:-self.positions]

    def skip(self, n: int) -> None:
        """The first ``n`` pending tokens are in the cache already (prefix caching copied them)."""
        self._cached(self.pending[:n])
        self.pending = self.pending[n:]

    def _restart_keep(self) -> int:
        """The committed tokens a restart feeds before its root: the draft_context, and within its
        positions at most half of them (the other half is the trees' room)."""
        return min(self.context or self.positions, self.positions // 2) if self.positions else self.context

    def holds(self, n: int) -> bool:
        """Whether ``n`` tokens (the root last) leave the trees after them a quarter of the draft's
        positions (always, where the draft has as many as the text may need)."""
        return not self.positions or n + self.positions // 4 <= self.positions

    def outgrows(self, n: int) -> bool:
        """Whether feeding ``n`` more tokens would pass :meth:`holds` (a restart is due first)."""
        return not self.holds(self.cache.length + n)

    def would_restart(self, cached: int, queued: int) -> bool:
        """Whether :meth:`prefill` restarts with ``cached`` tokens in the cache and ``queued`` queued
        (the root last): more than draft_context of them to catch up on, or more than the positions
        hold.  The one rule: the prefill, the engine's prompt prefill and prefix caching ask it."""
        return bool(self.context) and queued - 1 > self.context or not self.holds(cached + queued)

    def depth_room(self, max_depth: int) -> int:
        """``max_depth`` capped so that no tree node after the next root passes the draft's
        positions (the root where root() puts it: after a restart, if it must make one)."""
        if not self.positions:
            return max_depth
        root_pos = self._restart_keep() if self.outgrows(len(self.pending)) else \
            self.cache.length + len(self.pending) - 1
        return min(max_depth, self.positions - 1 - root_pos)

    def prefill(self):
        """Feed the queued tokens before the root the way the target cached them, leaving the root
        queued.  A prompt runs in draft forwards of its own before the row's first tree
        (engine.BatchDecoder._draft_prefill), so that tree costs its levels alone, as every
        later one does (the batched budget compares iterations' costs).  With a window, the
        tokens go in the pieces the target's prefill uses, evicting between them, so the draft
        keeps the same sinks and recent tokens as the target.  A generator (see the class)."""
        restart = self.would_restart(self.cache.length, len(self.pending))
        todo, self.pending = self.pending[:-1], self.pending[-1:]
        if restart:
            # catching up would feed len(todo) tokens; a restart on the latest `context` costs fewer,
            # and a draft reads little context (the README's *Draft context*); or the text outgrew
            # the draft's positions
            text = self.text + todo  # (with positions: the cached text, then what is queued)
            self.cache.shared = None  # (dropped, not copied in: nothing of it is kept)
            self.cache.truncate(0)
            self.text = []
            todo = (text if self.positions else todo)[-self._restart_keep():]
            self.restarts += 1
        while todo:
            if self.window is not None and self.cache.length >= self.window.size:
                # a restarted draft (above) evicts on its own schedule, so its cache can be full here
                self.window.make_room(self.cache, 1)
            room = len(todo) if self.window is None else self.window.size - self.cache.length
            piece, todo = todo[:room], todo[room:]
            yield from self._feed(piece)
            if self.window is not None:
                self.window.make_room(self.cache, 1)

    @staticmethod
    def _proposals(out, k: int) -> tuple[list[list[float]], list[list[int]]]:
        """A draft forward's Output -> per row k proposals: confidences and token ids (host
        lists).  They are the forward's own top-k head (fused into the native kernel; perturbed
        when sampling: sampling.head), or under top-k / top-p what :func:`drive` drew there; a
        packed forward asks for the largest k, so rows are cut to theirs."""
        vals, ids = out.top
        return [v[:k] for v in vals], [t[:k] for t in ids]

    def root(self, k: int):
        """Feed pending committed tokens (ending with the root); top-k of the root's next token.
        A generator (see the class); returns (probabilities, ids)."""
        self._reset_tree()
        if self.window is not None:
            if len(self.pending) > 1 and self.cache.length + len(self.pending) > self.window.size:
                # The target cached these tokens before it evicted, so their upper layers saw the
                # chunk that leaves; fed after the eviction they would not, and a perfect draft
                # would disagree with its target.  So cache them first (once per evicted chunk).
                yield from self.prefill()
            self._make_room()
        elif self.outgrows(len(self.pending)):
            yield from self.prefill()  # (a restart: the text outgrew the draft's positions)
        out = yield from self._feed(self.pending, min(k, self.vocab), head(self.sampler, [0]))
        vals, idx = self._proposals(out, min(k, self.vocab))
        self.pending = []
        self.base = self.cache.length
        self.root_pos = self.base - 1
        self.started = True
        return vals[0], idx[0]

    def _make_room(self) -> None:
        """Evict under the window so that the pending tokens fit.  The draft evicts at the same
        token counts as the target, with the same tokens cached (prefill and root see to it), so
        its root sits at the target's position; the cut below is a safety net (it would change
        proposals, never the output)."""
        self.window.make_room(self.cache, len(self.pending))
        spare = self.window.size - self.cache.length
        if len(self.pending) > spare:
            self.pending = self.pending[-spare:]

    def expand(self, tree: Tree, nodes: list[int], k: int):
        """One draft forward over ``nodes`` (any depths); top-k of each node's next token.
        A generator (see the class); returns (probabilities, ids) per node."""
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
        ids = long_tensor([tree.tokens[u] for u in nodes], dev)  # (n,)
        depths = [tree.depths[u] for u in nodes]
        pos = long_tensor([self.root_pos + d for d in depths], dev)  # (n,)
        out = yield DraftCall(Seq(ids, self.cache, pos, mask, perturb=head(self.sampler, depths)), min(k, self.vocab),
                              depths)
        self.forwards += 1
        self.fed_tokens += n
        return self._proposals(out, min(k, self.vocab))

    @_inference
    def commit(self, path: list[int], committed: list[int]) -> None:
        """Keep the expanded nodes of the accepted ``path`` (node indices from the root) in the cache.

        ``committed`` are this iteration's new tokens: the path's drafted tokens, then the bonus.
        """
        t0 = time.perf_counter()
        self._in_vocab(committed[-1:])  # the bonus: the drafted ones came from the draft
        if not self.started:
            self.pending.extend(committed)
            return
        fed = []
        for u in path[1:]:
            if u not in self.slot:
                break
            fed.append(self.slot[u])
        self.cache.keep(self.base, fed)
        self._cached(committed[:len(fed)])
        self.pending = list(committed[len(fed):])
        self._reset_tree()
        self.seconds += time.perf_counter() - t0


class ForwardClock:
    """Seconds a decoder has spent inside model forwards, every row's: a row's ``forward_time_s`` is
    the clock's advance while the row was in the decoder (a neighbour's prefill holds it up too)."""

    __slots__ = ("seconds",)

    def __init__(self):
        self.seconds = 0.0


@_inference
def drive(jobs: list[tuple[Drafter, object]], clock: ForwardClock | None = None) -> list:
    """Advance several sequences' drafting generators (policies' ``grow``) together: each round,
    every generator still drafting has asked for one draft forward, and the round runs them all
    as one packed forward (its time on ``clock``).  Returns each generator's result (its tree).

    Each drafter is charged every round it took part in (its wall time: the forward and the
    rounds' tree growth), which is what its level cost the batch."""
    results: list = [None] * len(jobs)
    calls: dict[int, DraftCall] = {}

    def advance(i: int, value) -> None:
        try:
            calls[i] = jobs[i][1].send(value)
        except StopIteration as stop:
            results[i] = stop.value

    t0 = time.perf_counter()
    for i in range(len(jobs)):
        advance(i, None)
    idx: list[int] = []
    while calls:
        idx = list(calls)
        batch = [calls.pop(i) for i in idx]
        lead = jobs[idx[0]][0]
        heads = [c.k for i, c in zip(idx, batch) if in_head(jobs[i][0].sampler)]
        tf = time.perf_counter()
        outs = lead.model.forward([c.seq for c in batch], topk=max(heads, default=0), cols=lead.vocab)
        if not heads and lead.device.type == "cuda":
            torch.cuda.synchronize(lead.device)  # nothing was read back: wait, so tf is the forward's time
        if clock is not None:
            clock.seconds += time.perf_counter() - tf
        _propose_masked([(jobs[i][0], c, out) for i, c, out in zip(idx, batch, outs)])
        t0 = _charge(jobs, idx, t0)  # before advancing: a policy reads its time spent so far
        for i, out in zip(idx, outs):
            advance(i, out)
    _charge(jobs, idx, t0)
    return results


def _propose_masked(calls: list[tuple[Drafter, DraftCall, object]]) -> None:
    """Drafters sampling under top-k / top-p take their proposals from their masked, perturbed
    scores, not from a head fused into the forward: all of them in one host sync
    (sampling.propose_each), put where the head's top-k goes (Output.top)."""
    todo = [(d, c, out) for d, c, out in calls if c.k and not in_head(d.sampler)]
    if todo:
        got = propose_each([d.sampler for d, _, _ in todo], [out.logits[0, :, :d.vocab] for d, _, out in todo],
                           [c.depths for _, c, _ in todo], [c.k for _, c, _ in todo])
        for (_, _, out), top in zip(todo, got):
            out.top = top


def _charge(jobs, idx: list[int], t0: float) -> float:
    """Add the time since t0 to the drafters of ``idx``; returns now."""
    t1 = time.perf_counter()
    for i in idx:
        jobs[i][0].seconds += t1 - t0
    return t1


def run(drafter: Drafter, gen):
    """Drive one sequence's drafting generator alone (the B = 1 case of :func:`drive`)."""
    return drive([(drafter, gen)])[0]
