"""Hardware-aware tree budget: grow and verify only the nodes that pay for their time.

The paper's budget (N_max = 256, depth up to 8) suits an A100, where verifying 64 tokens costs
about what one does.  On a CPU, verification time grows with the tree, so the best tree is the
one that maximises expected committed tokens *per second*, not per iteration.

Ingredients, all measured on the actual device:

* :class:`LatencyModel` — target verification time for n tree tokens and draft time per tree
  level, profiled once per pair (a fraction of a second) at two cache lengths: attention over the
  cache makes every node dearer as a generation grows (at 1500 cached tokens the keys and values
  stream as many bytes as the weights), so verification is priced at the row's own length.
* :class:`Calibration` — the probability that the target agrees with a drafted token, as a
  function of the draft's conditional probability q of that token and its rank among its
  siblings (an under-confident draft's top-1 at q = 0.07 can still be right 60% of the time,
  while its second choice at the same q is right far less often).  DySpec's hypothesis is
  that q tracks acceptance; a poorly calibrated draft (top-1 q mostly < 0.4 even where right)
  breaks the identity, so it is learned online: every node whose parent was accepted was
  *tested*, and it was accepted or not.  Each cell starts from two pseudo-observations at its
  rank's pooled acceptance, which itself starts optimistic (two pseudo-acceptances): an estimate
  at q would starve itself, because nodes the budget never verifies are never observed, so the
  first cells of a rank get tested; later cells start where their rank stands.  (A prior of two
  acceptances per cell, until 2026-11-24, left the cells the budget rarely reaches -- a second
  child at high q, where siblings are added -- optimistic for good: sampled, a depth-2 second
  child was priced 0.37 and accepted 0.18 of the time, first children at depth 4 0.51 against
  0.35; with the pooled start, 0.27 / 0.11 (28 samples) and 0.49 / 0.49, 8 Gutenberg prompts at
  T = 0.8.  Tokens/s moved within the host's noise in two interleaved A/B rounds per file.)
* The value of a node is the calibrated probability that its whole path is accepted; the
  expected tokens an iteration commits are 1 (the bonus) + the sum of selected values.

Rules (R = best expected tokens per ms achievable with the nodes so far; δ = marginal
verification ms per extra token at the current size):

* a node is worth verifying iff value > R·δ (it adds more tokens than its time would earn at
  the current rate);
* another draft level is worth running iff, for some horizon L ≤ 3, extending every frontier
  node (those whose best child could clear the bar) by a chain of L first children adds more
  expected tokens, Σ value(u)·(ā + … + ā^L), than R × (L draft levels + the extra verification
  time), where ā is the calibrated acceptance of a first child.  One level alone often does not
  pay while three do (the verification cost is nearly flat from 2 to 8 tokens), so a one-step
  rule stops too early.

DynaTree's own mechanisms (confidence-driven breadth, depth gating, pruning, node budget,
history) still decide which children exist; the budget only decides how much of that tree is
drafted and verified.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import NATIVE_KERNELS
from .kvcache import new_cache
from .machine import env_on, replaced
from .names import local_dir, model_files
from .runtime import Seq

# Bumped when what a saved profile measures changes (2: the profile's masks reach the native
# kernel with their all-visible prefix, as the engine's do), so stale profiles are measured again.
PROFILE_VERSION = 2


@dataclass
class LatencyModel:
    verify_ms: dict[int, float]  # tree tokens -> ms per target forward, at short_at cached tokens
    draft_ms: dict[int, float]  # frontier width -> ms per draft forward
    # per-iteration time outside the draft levels and the verification (lookup, tree flattening,
    # acceptance, the draft's commit, bookkeeping): measured online (observe_overhead); profile()
    # starts it at a tenth of a one-token forward
    overhead_ms: float = 0.0
    long_ms: dict[int, float] | None = None  # verify_ms at long_at cached tokens (None: length-blind)
    short_at: int = 256
    long_at: int = 0
    # Online corrections (EMA of observed minus profiled ms): the profile times bare forwards,
    # while an iteration also pays tree growth, masks, top-k transfers, accept and commit.
    verify_extra_ms: float = 0.0
    draft_extra_ms: float = 0.0
    ema: float = 0.1
    measured: dict | None = None  # the tables as timed (the ones above may have a spike smoothed: _envelope)

    def __post_init__(self):
        # dense lookups for the sizes trees use: the budget asks for hundreds of values per iteration
        self._vt = [self._interp(self.verify_ms, n) for n in range(129)]
        self._vl = [self._interp(self.long_ms, n) for n in range(129)] if self.long_ms else None
        self._dt = [self._interp(self.draft_ms, w) for w in range(65)]

    # A residual is clipped to [-1/2, +1] x the profiled time: one stall on a shared host must not
    # make drafting look so dear that it stops, since a level that never runs is never re-measured.
    def observe_verify(self, n: int, ms: float, cached: int | None = None) -> None:
        prof = self._verify_at(n, cached)
        extra = min(max(ms - prof, -prof / 2), prof)
        self.verify_extra_ms += self.ema * (extra - self.verify_extra_ms)

    def observe_draft(self, width: int, ms: float) -> None:
        prof = self._profiled(self._dt, self.draft_ms, width)
        extra = min(max(ms - prof, -prof / 2), prof)
        self.draft_extra_ms += self.ema * (extra - self.draft_extra_ms)

    def observe_overhead(self, ms: float) -> None:
        """One iteration's time outside its draft levels and verification (engine.BatchDecoder:
        the whole batch's).  Why measured: a constant 1 ms stood here until 2026-11-29, when a
        one-token forward cost ~1 ms and this time ~0.15 ms on the bench pair (Zen 5); an
        overstated fixed cost per iteration makes every extra node look cheap by comparison, and
        the budget verified 5.4-6.6 nodes a tree where 4.0-5.4 decoded 4-7% faster."""
        cap = self._vt[1]  # one stall on a shared host must not price trees for long
        self.overhead_ms += self.ema * (min(max(ms, 0.0), cap) - self.overhead_ms)

    def relax(self) -> None:
        """Once per iteration: let the draft correction fade unless levels keep confirming it."""
        self.draft_extra_ms *= 1 - self.ema / 4

    @staticmethod
    def _interp(table: dict[int, float], x: float) -> float:
        ks = list(table)  # profile() fills tables in ascending size
        if x <= ks[0]:
            return table[ks[0]]
        for a, b in zip(ks, ks[1:]):
            if x <= b:
                return table[a] + (table[b] - table[a]) * (x - a) / (b - a)
        a, b = ks[-2], ks[-1]
        return table[b] + (table[b] - table[a]) / (b - a) * (x - b)

    @classmethod
    def _profiled(cls, dense: list[float], table: dict[int, float], x: int) -> float:
        return dense[x] if x < len(dense) else cls._interp(table, x)

    def _verify_at(self, n: int, cached: int | None) -> float:
        """Profiled ms for n tokens over ``cached`` keys: linear in the cache length between (and
        beyond) the two profiled lengths, as attention is."""
        short = self._profiled(self._vt, self.verify_ms, n)
        if cached is None or self._vl is None:
            return short
        long = self._profiled(self._vl, self.long_ms, n)
        return short + (long - short) * (cached - self.short_at) / (self.long_at - self.short_at)

    def verify(self, n: int, cached: int | None = None) -> float:
        return self._verify_at(n, cached) + self.verify_extra_ms

    def draft(self, width: int) -> float:
        return self._profiled(self._dt, self.draft_ms, width) + self.draft_extra_ms

    def spent(self, ms: float) -> float:
        """The part of ``ms`` of drafting wall time that is this sequence's (all of it alone)."""
        return ms

    def view(self, others: int, share: int, scale: float = 1.0, cached: int | None = None) -> "LatencyModel | BatchView":
        """This model as one row of a batch sees it (``share`` rows; ``others`` tokens from the
        other rows in each target forward; ``scale``: see :class:`Governor`; ``cached``: the
        row's cache length)."""
        if share <= 1:
            return self if cached is None else BatchView(self, 0, 1, 1.0, cached)
        return BatchView(self, others, share, scale, cached)


@dataclass
class BatchView:
    """A :class:`LatencyModel` as one row of a batched iteration sees it (engine.BatchDecoder).

    The rows share every forward.  A row pays its share of the batch's base cost (a forward over
    every row's root, and the iteration's bookkeeping) and the *whole* marginal cost of its own
    nodes on top of the ``others`` tokens the other rows bring, so its rate (tokens per ms of its
    share) times the marginal cost is the batch's bar: when the batch makes the forward
    compute-bound, a node costs what it really costs and only confident ones are verified; a draft
    level costs its share of a level over all rows' frontiers.  With one row it is the model
    itself."""

    lat: LatencyModel
    others: int
    share: int
    scale: float = 1.0  # on every marginal cost (Governor)
    cached: int | None = None  # the row's cache length (LatencyModel.verify)
    # verify(n) per n: a view lives for one tree's growth, during which verification times do not
    # change (observe_verify runs after the forward), and the budget asks for the same n many times
    _memo: dict = field(default_factory=dict, repr=False, compare=False)
    _base: float | None = field(default=None, repr=False, compare=False)

    @property
    def overhead_ms(self) -> float:
        return self.lat.overhead_ms / self.share

    def verify(self, n: int) -> float:
        got = self._memo.get(n)
        if got is None:
            v, at = self.lat.verify, self.cached
            base = self._base  # the terms every n shares: its share of the roots, less the others' forward
            if base is None:
                base = self._base = v(self.share, at) / self.share - self.scale * v(self.others + 1, at)
            got = self._memo[n] = base + self.scale * v(self.others + n, at)
        return got

    def draft(self, width: int) -> float:
        return self.scale * self.lat.draft(width * self.share) / self.share

    def spent(self, ms: float) -> float:
        return ms / self.share

    def observe_draft(self, width: int, ms: float) -> None:
        self.lat.observe_draft(width * self.share, ms)

    def relax(self) -> None:
        self.lat.relax()


@dataclass
class Governor:
    """Keeps the batched budget honest with measurements (engine.BatchDecoder, B > 1).

    The budget's model of a batched iteration leaves things out (per-row bookkeeping, the draft's
    real cost at that width), and a wrong model could make trees slower than plain batched ``ar``.
    So iterations are of two kinds: *drafted* ones, and ones where the budgeted rows draft nothing
    (every row a bare root: exactly a batched ``ar`` step).  They run in *segments* of ``segment``
    iterations of one kind and one row count (a segment whose row count changes -- rows finished
    -- is dropped and begins again), and each whole segment's tokens per ms, the drafts' catch-up
    after plain stretches included, updates that kind's rate (bias-corrected EMAs over segments).
    Drafted segments *win* when they beat plain ones by ``margin`` (:meth:`winning`).  While they
    win, one segment in ``every`` is plain (so ``ar``'s rate stays measured) -- one in more where
    they win by more (:meth:`cycle`); while they lose,
    ``gap`` plain segments run between drafted ones, doubling up to ``max_gap``, halved by a win
    (32: where trees lose, an exploration costs its segment up to 2.6x a plain one -- 6.9 ms against
    2.6 ms per iteration, Gutenberg, B = 4, Intel Emerald Rapids -- and one in 9 segments, the cap
    until 2026-11-28, held batched ``dynatree`` 5-7% under trees-off, one in 33 about 3%).
    ``scale`` -- the factor on every node's and draft level's marginal cost (:class:`BatchView`)
    -- rises while drafted segments lose, shrinking trees, and falls back toward 1 while they win.

    Why segments, not single iterations (until 2026-11-28: one plain probe every 8 iterations,
    judged alone, the catch-up left out): an iteration's rate varies by ±30% on a shared 2-vCPU
    host, and a plain iteration inside a tree-heavy decode sometimes ran 1.6x slower than the same
    step in a plain run (Intel Emerald Rapids, B = 4: 3.4-3.6 ms against 2.2 ms for four bare
    roots; cause not found -- it stays in plain segments, biasing them a few percent, which the
    margin also absorbs), so the few probes of a tree-heavy decode said trees won while they lost:
    batched ``dynatree`` ran at 0.73-0.89x ``ar``, as with trees always on, where trees off ran at
    0.87-1.01x.  Where the forward is compute bound (many rows on a few cores) a verified node
    costs about a token's compute, trees cannot pay, and each exploration is a loss, hence the
    backoff.  :meth:`carry` starts a later batch's governor from this one (engine.BatchDecoder
    keeps one per batch size and method), so a run of short batches does not learn from scratch.
    """

    segment: int = 8
    every: int = 4
    probe_cost: float = 0.05  # the share of the time plain segments may cost while drafting wins
    max_gap: int = 32
    ema: float = 0.3
    margin: float = 0.05
    scale: float = 1.0
    max_scale: float = 64.0
    gap: int = 1  # plain segments between drafted ones while drafting loses
    ar_rate: float | None = None
    tree_rate: float | None = None
    iteration: int = 0
    ar_n: int = 0  # segments of each kind so far
    tree_n: int = 0
    drafting: bool = False  # the current segment's kind (the first is plain: ar's rate first)
    left: int = 0  # iterations left in the current segment
    rows: int = 0  # its row count
    plain_run: int = 0  # plain segments since the last drafted one
    tree_run: int = 0  # drafted segments since the last plain one
    seg_tokens: float = 0.0
    seg_ms: float = 0.0

    def carry(self) -> "Governor":
        """A governor for the next batch of this size: the scale, the gap and how far this one had
        counted through it (so batches too short to reach a drafted segment still do, in turn:
        restarting the count each batch kept trees off for good), rates measured afresh (the next
        batch's prompts and caches are its own).  The scale is carried whole: decayed toward 1 at
        each batch (its square root), explorations where trees lose drafted full trees again, and
        batched ``dynatree`` fell from 0.92 to 0.85x ``ar`` (Gutenberg, B = 4, Emerald Rapids); a
        winning drafted segment still lowers it."""
        return Governor(segment=self.segment, every=self.every, probe_cost=self.probe_cost,
                        max_gap=self.max_gap, ema=self.ema, margin=self.margin, scale=self.scale,
                        max_scale=self.max_scale, gap=self.gap, plain_run=min(self.plain_run, self.gap))

    def winning(self) -> bool:
        """Whether drafted segments beat plain ones by the margin, which stands for what trees cost
        outside the segments -- a static batch's ragged end (rows that drafted finish apart, and the
        last ones decode in a smaller batch) and each prompt's prefill through the draft -- so a
        tie goes to plain steps."""
        return (self.tree_rate is not None and self.ar_rate is not None
                and self.tree_rate >= self.ar_rate * (1 + self.margin))

    def skip_drafting(self, rows: int = 0) -> bool:
        """Whether the coming iteration, over ``rows`` rows, runs without drafting (see the class).
        The first segment is plain, so the comparison starts at once; the next drafts, or, after a
        carried ``gap`` (trees lost in the last batch of this size), the one after ``gap`` plain
        segments."""
        if self.left > 0 and rows != self.rows:
            self.left = 0  # rows left the batch: the segment's iterations so far are not comparable
        if self.left <= 0:
            if self.ar_rate is None:
                self.drafting = False
            elif self.winning():
                self.drafting = self.tree_run < self.cycle() - 1
            else:
                self.drafting = self.plain_run >= self.gap
            self.left, self.rows, self.seg_tokens, self.seg_ms = self.segment, rows, 0.0, 0.0
        return not self.drafting

    def cycle(self) -> int:
        """Segments per plain one while drafting wins: ``every``, or more where trees win by more,
        so that the plain segments cost at most ``probe_cost`` of the time -- each runs at ``ar``'s
        rate instead of the trees', losing 1 - ar/tree of a segment (at most ``max_gap``).  Why:
        where a forward is memory-bound (Pythia-2.8B's size on a 2-core CPU, B = 4) drafted
        segments committed 1.7x the tokens per ms of plain ones, and one plain segment in four
        cost ~10% of the decode."""
        loss = 1.0 - self.ar_rate / self.tree_rate
        return max(self.every, min(self.max_gap, math.ceil(loss / self.probe_cost - 1e-9)))

    def pause(self) -> None:
        """The batch moved to another size's governor: drop the segment under way (its iterations
        and the ones after the batch comes back would be far apart)."""
        self.left = 0

    def _mean(self, old: float | None, rate: float, n: int) -> float:
        return rate if old is None else old + max(self.ema, 1 / n) * (rate - old)

    def observe(self, tokens: int, ms: float, skipped: bool) -> None:
        """One iteration's committed tokens (all rows), wall ms, and whether it drafted."""
        self.iteration += 1
        self.left -= 1
        self.seg_tokens += tokens
        self.seg_ms += max(ms, 0.0)
        if self.left > 0 or self.seg_ms <= 0:
            return
        rate = self.seg_tokens / self.seg_ms
        if skipped:
            self.ar_n += 1
            self.plain_run += 1
            self.tree_run = 0
            self.ar_rate = self._mean(self.ar_rate, rate, self.ar_n)
            return
        self.tree_n += 1
        self.plain_run = 0
        self.tree_run += 1
        self.tree_rate = self._mean(self.tree_rate, rate, self.tree_n)
        if self.ar_rate is None:
            return
        if not self.winning():
            self.scale = min(self.scale * 1.1, self.max_scale)
            self.gap = min(self.gap * 2, self.max_gap)
        else:  # (halved, not reset: one lucky segment -- a stretch of text the lookup copies -- is not a trend)
            self.scale = max(self.scale / 1.05, 1.0)
            self.gap = max(self.gap // 2, 1)


def _time_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def _profile_model(model, prefix_len: int, sizes, repeats: int, kv_dtype: str = "model") -> dict[int, float]:
    dev = model.device
    vocab = model.config.vocab_size
    cache = new_cache(model, prefix_len + max(sizes) + 1, kv_dtype)
    gen = torch.Generator().manual_seed(0)
    _zero_prefix(model, cache, prefix_len, vocab, gen)
    out = {}
    chains = bool(getattr(model, "tree_problem", ""))  # it verifies chains: causal steps, no tree mask
    for n in sizes:
        ids = torch.randint(0, vocab, (1, n), generator=gen).to(dev)
        mask = None
        if not chains:
            mask = torch.zeros((1, 1, n, prefix_len + n), dtype=model.dtype, device=dev)
            mask[..., prefix_len:] = torch.full((n, n), torch.finfo(model.dtype).min, dtype=model.dtype,
                                                device=dev).triu(1)
        pos = torch.arange(prefix_len, prefix_len + n, device=dev)[None]

        def step():
            model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
            cache.truncate(prefix_len)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

        t0 = time.perf_counter()
        step()  # warm-up, and a first reading: a slow forward is timed fewer times (PROFILE_MS)
        first_ms = (time.perf_counter() - t0) * 1e3
        out[n] = _time_ms(step, min(repeats, (round(PROFILE_MS / max(first_ms, 1e-3)) - 1) | 1))
    return out


# Milliseconds of timing per forward size, roughly: a forward slower than PROFILE_MS / repeats is
# timed fewer times (an odd number, at least once).  At Pythia-2.8B's size on a 2-core CPU (0.2-1.4
# s per forward) five timings of every size, over two cache lengths, were most of a job's 86 s
# start-up; the online corrections (LatencyModel.observe_*) refine what one timing misses.
PROFILE_MS = 1000.0


def _zero_prefix(model, cache, prefix_len: int, vocab: int, gen) -> None:
    """``prefix_len`` cached tokens of zero keys and values: a forward over them costs what it
    costs over real ones (the same reads and FLOPs), without a prefill of that many tokens (25 s
    for 1024 at Pythia-2.8B's size on 2 cores).  One real token lays the buffers out."""
    one = torch.randint(0, vocab, (1, 1), generator=gen).to(model.device)
    model(input_ids=one, past_key_values=cache, use_cache=True, logits_to_keep=1)
    for layer in cache.layers:
        layer.keys[:, :, :prefix_len].zero_()
        layer.values[:, :, :prefix_len].zero_()
        layer.length = prefix_len


@torch.inference_mode()
def time_prefill(model, n: int, repeats: int, kv_dtype: str = "model") -> float:
    """Median ms of a prefill: a causal forward over an n-token prompt into an empty cache, keeping
    the last row's logits as the engine's prefill does (a longer one goes through the native
    kernel in chunks, not to torch's path)."""
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    ids = ids.to(model.device)
    cache = new_cache(model, n + 1, kv_dtype)

    def step():
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache.truncate(0)
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)

    step()  # warm-up
    return _time_ms(step, repeats)


@torch.inference_mode()
def time_sequences(model, prefix_len: int, n: int, repeats: int, kv_dtype: str = "model",
                   max_bytes: int = 2**30) -> tuple[float, float, int, int] | None:
    """Median ms of one forward of ``n`` sequences of one token, each over its own ``prefix_len``
    cached tokens (a batched decode step), and of one sequence of ``n`` tokens over one such cache
    (a tree's verification, what :func:`profile` times); the bytes of keys and values one
    sequence's cache holds; and ``n`` -- fewer where ``n`` caches would pass ``max_bytes``.  The
    difference is what each extra sequence costs beyond its token's compute (`dynatree profile`):
    on the native kernel, reading its own keys and values.  None where not even two caches fit."""
    if n < 2:
        return None
    dev = model.device
    gen = torch.Generator().manual_seed(0)

    def filled():
        cache = new_cache(model, prefix_len + n + 1, kv_dtype)
        _zero_prefix(model, cache, prefix_len, model.config.vocab_size, gen)
        return cache

    caches = [filled()]
    kv = sum(l.keys[:, :, :prefix_len].nbytes + l.values[:, :, :prefix_len].nbytes for l in caches[0].layers)
    n = min(n, max_bytes // max(kv, 1))
    if n < 2:
        return None
    caches += [filled() for _ in range(n - 1)]
    ids = torch.randint(0, model.config.vocab_size, (n,), generator=gen).to(dev)

    def step(seqs):
        model.forward(seqs, argmax=True)
        for c in caches:
            c.truncate(prefix_len)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    apart = [Seq(ids[i:i + 1], c, keep=1) for i, c in enumerate(caches)]  # (1,) each
    together = [Seq(ids, caches[0], keep=n)]  # (n,)
    times = []
    for seqs in (apart, together):
        step(seqs)  # warm-up
        times.append(_time_ms(lambda: step(seqs), repeats))
    return times[0], times[1], kv, n


def _envelope(ms: dict[int, float], spike: float = 1.5) -> dict[int, float]:
    """A size timed while the machine was busy (an 8-token forward at 49 ms beside 1.9 ms for 12
    tokens, found in a cached profile) takes the cheapest larger size's time -- else trees priced
    off by it never reach that size, and the online correction never sees what it really costs.
    Only a spike (``spike`` x that time): the budget is sensitive to the small sizes' ordinary
    noise (1 token timed 5% above 2 tokens), which stays as measured."""
    out, least = {}, float("inf")
    for n in sorted(ms, reverse=True):
        out[n] = least if ms[n] > spike * least else ms[n]
        least = min(least, ms[n])
    return dict(sorted(out.items()))  # ascending, as measured: LatencyModel reads the sizes in order


def profile(pair, prefix_len: int = 256, sizes=(1, 2, 4, 8, 12, 16, 32, 64), widths=(1, 4, 16),
            repeats: int = 5, fresh: bool = False, kv_dtype: str = "model") -> LatencyModel:
    """Measure verification and draft-level latency on this device, over caches that store keys
    and values as ``kv_dtype`` (config.KV_DTYPES: a bfloat16 cache halves the bytes each forward
    streams, so its forwards cost less at long lengths).  Cached on the pair, and on disk per
    machine, models, kernel, thread count and kv_dtype (see :func:`_disk_path`); ``fresh``
    measures again whatever is cached (`dynatree profile`) and keeps the new tables."""
    key = ("latency", prefix_len, kv_dtype)
    if key in pair.state and not fresh:
        return pair.state[key]
    # a context too short for the largest forwards: the sizes that fit (the model extrapolates)
    sizes, widths = fitting(sizes, pair.max_context), fitting(widths, pair.context_of("draft"))
    prefix_len = within(pair, "target", prefix_len, sizes)
    long_at = min(4 * prefix_len, pair.max_context - max(sizes) - 1)
    long_at = long_at if long_at >= 2 * prefix_len else 0  # too short a context to tell the slope
    # (kv_dtype joins the key only when set, so profiles saved before it existed stay valid)
    path = _disk_path(pair, (prefix_len, long_at, sizes, widths, repeats) + ((kv_dtype,) if kv_dtype != "model" else ()))
    try:
        saved = json.loads(path.read_text()) if path and not fresh else None
        tables = {k: {int(n): v for n, v in saved[k].items()} if saved[k] else None
                  for k in ("verify_ms", "draft_ms", "long_ms")} if saved else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # absent or damaged: measure again
        tables = None
    if tables is None:
        target = pair.runner("target")
        tables = {"verify_ms": _profile_model(target, prefix_len, sizes, repeats, kv_dtype),
                  "draft_ms": (_profile_model(pair.runner("draft"), within(pair, "draft", prefix_len, widths),
                                              widths, repeats, kv_dtype)
                               if pair.draft is not None else {w: 0.0 for w in widths}),  # (ar alone: free)
                  "long_ms": _profile_model(target, long_at, sizes, repeats, kv_dtype) if long_at else None}
        if path:
            _save(path, tables)
    lm = LatencyModel(**{k: _envelope(v) if v else v for k, v in tables.items()}, short_at=prefix_len,
                      long_at=long_at, measured=tables)
    lm.overhead_ms = 0.1 * lm.verify(1)  # a start; observe_overhead learns it within ~20 iterations
    pair.state[key] = lm
    return lm


def fitting(sizes, context: int) -> tuple:
    """The forward sizes a context holds, at least two (a slope: one point left a draft of 4
    positions with a table nothing extrapolates from, an IndexError)."""
    fit = tuple(n for n in sizes if n + 1 < context)
    return fit if len(fit) >= 2 else (1, 2)


def within(pair, which: str, prefix_len: int, sizes) -> int:
    """``prefix_len`` lowered so that its largest forward stays inside the model's positions (a draft
    shorter than its target: ModelPair.draft_positions)."""
    return max(0, min(prefix_len, pair.context_of(which) - max(sizes) - 1))


def _disk_path(pair, params) -> Path | None:
    """Where a profile of this pair on this machine is kept, or None when the models are not
    files (built in memory) or it is turned off (``DYNATREE_PROFILE_CACHE=0``).  A stale profile
    only costs accuracy: the online corrections (LatencyModel.observe_*) track the real times."""
    if not env_on("DYNATREE_PROFILE_CACHE"):
        return None
    files = []
    for name in (pair.names.get("target"), pair.names.get("draft")):
        where = local_dir(name) if name else None  # (a hub id's snapshot: every actor had profiled again)
        if where is None:
            return None
        files += model_files(where)
    from . import kbuild, native
    cpu = kbuild.cpuinfo("model name")
    device = str(pair.device)
    if pair.device.type == "cuda":  # a GPU's times are its model's, whatever CPU sits beside it
        device += " " + torch.cuda.get_device_name(pair.device)
    blob = json.dumps([files, cpu, os.cpu_count(), torch.get_num_threads(), pair.kernel, device,
                       str(pair.dtype), (native.variant(), native.source_hash()) if pair.kernel in NATIVE_KERNELS else None, params,
                       torch.__version__, PROFILE_VERSION])
    return kbuild.cache_dir() / "profiles" / f"{hashlib.sha256(blob.encode()).hexdigest()[:20]}.json"


def _save(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with replaced(path, path.with_suffix(f".{os.getpid()}.tmp")) as tmp:
            tmp.write_text(json.dumps(data))
    except OSError:
        pass  # an unwritable cache only means profiling again next time


@dataclass
class Calibration:
    """P(target agrees with a drafted token | draft probability q, sibling rank), learned online."""

    bins: int = 20
    ranks: int = 4  # ranks 0, 1, 2 and "3 or later" are calibrated separately
    prior: float = 2.0  # pseudo-observations per cell at its rank's pooled acceptance (module docstring)

    def __post_init__(self):
        self.tested = [[0.0] * self.bins for _ in range(self.ranks)]
        self.accepted = [[0.0] * self.bins for _ in range(self.ranks)]
        # Drafted nodes whose test is under way (batched MCTS's "virtual loss"): in a batch every
        # row grows its tree before any is verified, and without this 64 rows would all spend
        # the optimistic prior on the same untested cells at once (measured: a first batched
        # iteration verifying 1740 nodes for 257 tokens, 0.8 s).  A held node counts as tested
        # with the cell's observed mean (0 if untested), so it dilutes the prior's optimism and
        # leaves a well-measured cell's estimate where it is.
        self.held = [[0] * self.bins for _ in range(self.ranks)]
        self.rank_tested, self.rank_accepted = [0.0] * self.ranks, [0.0] * self.ranks

    def _cell(self, q: float, rank: int) -> tuple[int, int]:
        return min(rank, self.ranks - 1), min(int(q * self.bins), self.bins - 1)

    def __call__(self, q: float, rank: int = 0) -> float:
        r, b = self._cell(q, rank)
        t, a, h = self.tested[r][b], self.accepted[r][b], self.held[r][b]
        mean = a / t if t else 0.0
        return (a + self.prior * self._pooled(r) + h * mean) / (t + self.prior + h)

    def _pooled(self, r: int) -> float:
        """Rank r's acceptance over all q, from the same optimistic start."""
        t, a = self.rank_tested[r], self.rank_accepted[r]
        return (a + self.prior) / (t + self.prior)

    def hold(self, q: float, rank: int) -> tuple[int, int]:
        """A node in cell (q, rank) is on its way to being tested; returns the cell to release."""
        r, b = self._cell(q, rank)
        self.held[r][b] += 1
        return r, b

    def release(self, cells: list[tuple[int, int]]) -> None:
        for r, b in cells:
            self.held[r][b] -= 1

    def top1(self) -> float:
        """Calibrated acceptance of a node's first child over all q (for look-ahead)."""
        return self._pooled(0)

    def update(self, q: float, ok: bool, rank: int) -> None:
        r, b = self._cell(q, rank)
        self.tested[r][b] += 1
        self.accepted[r][b] += ok
        self.rank_tested[r] += 1
        self.rank_accepted[r] += ok


def worth_drafting(values: list[float], a: float, rate: float, lat: LatencyModel, n: int,
                   horizon: int = 3) -> bool:
    """values: frontier nodes' values; n: tree tokens verified so far.  See the module rules."""
    width, s = len(values), sum(values)
    gain, base = 0.0, lat.verify(n)
    for depth in range(1, horizon + 1):
        gain += s * a ** depth
        cost = depth * lat.draft(width) + lat.verify(n + depth * width) - base
        if gain > rate * cost:
            return True
    return False


def select(values: list[float], lat: LatencyModel, spent_ms: float) -> tuple[int, float, float]:
    """Choose how many of the best nodes to verify.

    values: per non-root node, sorted descending.  Returns (k, rate tokens/ms, marginal δ ms).
    """
    verify, overhead = lat.verify, lat.overhead_ms  # (looked up once: this runs every draft level)
    best_k, best_rate, s = 0, 1.0 / (spent_ms + verify(1) + overhead), 0.0
    for k, v in enumerate(values, start=1):
        s += v
        rate = (1.0 + s) / (spent_ms + verify(k + 1) + overhead)
        if rate > best_rate:
            best_k, best_rate = k, rate
    n = best_k + 1
    delta = max(lat.verify(n + 4) - lat.verify(n), 1e-3) / 4
    return best_k, best_rate, delta
