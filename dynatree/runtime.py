"""The runtime boundary: what the engine hands a model runner and what it gets back.

A runner (lean.LeanNeoX, packed.PackedRunner, models.HFRunner) scores the new
tokens of one or several sequences in one call::

    outs = runner.forward([Seq(ids, cache, positions, mask, keep), ...], topk=k | argmax=True, cols=V)

Each :class:`Seq` carries its own KV cache (a kvcache.BufferCache holding ``cache.length`` tokens),
its new token ids, their positions and which keys they may see (:class:`KeyMask`, or causal), and
how many of its last rows' logits to return, and for a sampled sequence the :class:`Perturb`
its heads read.  The runner returns one :class:`Output` per sequence: those logits and the heads
the engine reads (softmax top-k for drafting, argmax for verification) as host lists.  The native kernel packs every sequence's rows into one
forward (one stream over the weights) and is batch invariant, so a sequence's results do not
depend on its neighbours; lean.py's torch path and packed.py (Llama-family models) pack the GEMMs
too (attention per sequence), and transformers' runner joins them into one forward, attention per
sequence (joined.py), or pads them (padded.py) where rows share a block, each where a load-time
probe finds that it leaves each sequence's logits its own, else loops over them.

Kernels and their types (ctypes, packed weights, C structs) stay behind this interface.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .names import binding_window


def base_forward_source(model) -> str:
    """The source of the model's decoder forward (where transformers builds its masks), or ""."""
    try:
        return inspect.getsource(type(getattr(model, "base_model", model)).forward)
    except (OSError, TypeError):
        return ""


def model_window(model) -> int | None:
    """The sliding attention window ``model`` applies (names.binding_window), where its
    architecture's code applies one: a config may carry the key anyway (a Llama's stray
    sliding_window or layer_types change nothing in transformers' Llama)."""
    window = binding_window(model.config)
    return window if window is not None and "sliding_window" in base_forward_source(model) else None


@dataclass(frozen=True)
class KeyMask:
    """Which cached keys each of n new tokens may attend to: all of the first ``visible`` (the
    committed prefix), and among the rest (the new tokens, and for the draft its earlier tree
    levels) those marked in ``allowed``.

    The compact form is what the native kernel reads; :meth:`additive` gives the 4-D additive
    mask transformers' forwards take.
    """

    visible: int
    allowed: torch.Tensor  # (n, m) bool, m = keys after the visible prefix

    @staticmethod
    def from_additive(mask: torch.Tensor) -> "KeyMask":
        """The compact form of an additive (1, 1, n, k) mask (0 where a key is allowed): the
        leading keys every row may see become ``visible`` -- the native kernel walks those without
        reading a mask, so a forward costs what the engine's own masks cost."""
        ok = mask.reshape(mask.shape[-2], -1) == 0  # (n, k)
        visible = int(ok.all(0).to(torch.int8).cumprod(0).sum())  # kept host sync: the mask's shape
        return KeyMask(visible, ok[:, visible:])

    def additive(self, dtype: torch.dtype) -> torch.Tensor:
        """(1, 1, n, visible + m) in ``dtype``: 0 where attention is allowed, the dtype's minimum elsewhere."""
        n, m = self.allowed.shape
        mask = torch.zeros((n, self.visible + m), dtype=dtype, device=self.allowed.device)
        mask[:, self.visible:].masked_fill_(~self.allowed, torch.finfo(dtype).min)
        return mask[None, None]

    def beyond_window(self, positions: torch.Tensor, window: int) -> torch.Tensor:
        """(n, visible + m) bool: the keys a sliding attention window of ``window`` tokens hides
        from each row (transformers' rule: a query at position p sees keys at p - window + 1 .. p),
        where ``positions`` (n,) are the rows' positions.  The visible prefix's key j is at
        position j (no cache window evicts beside a model's own window), and a row's allowed keys
        are its ancestors up to itself in depth order (a tree path: engine and drafting masks), so
        its t-th allowed key from the end is t positions back."""
        n, m = self.allowed.shape
        p = positions.reshape(n, 1).to(self.allowed.device)
        prefix = torch.arange(self.visible, device=self.allowed.device)[None] <= p - window  # (n, visible)
        allowed = self.allowed.to(torch.int32)
        back = allowed.flip(1).cumsum(1).flip(1) - allowed  # (n, m): allowed keys after each column
        return torch.cat((prefix, back >= window), dim=1)


@dataclass(frozen=True)
class Perturb:
    """Sampling's heads (sampling.py): the heads of a sequence's kept rows read the perturbed
    scores ``logits * inv_temp + noise`` (the product rounded, then the add) instead of its
    logits, and those scores replace the logits they read in the Output."""

    inv_temp: float
    noise: Callable[[int], list]  # width -> one (width,) float32 CPU tensor per kept row


@dataclass
class Seq:
    """One sequence's new tokens in a (possibly packed) forward."""

    ids: torch.Tensor  # (n,) int64
    cache: object  # kvcache.BufferCache with the sequence's cached tokens; the n new ones are appended
    positions: torch.Tensor | None = None  # (n,) int64; None: cache.length .. cache.length + n - 1
    mask: KeyMask | None = None  # None: causal over the new tokens, all of the cache
    keep: int = 0  # logits of the last ``keep`` rows; 0: all n
    perturb: Perturb | None = None  # sampled rows: what the heads read

    @property
    def kept(self) -> int:
        """How many rows' logits the forward returns (the last ones)."""
        n = len(self.ids)
        return min(self.keep, n) if self.keep else n

    def position_ids(self, device) -> torch.Tensor:
        """(n,) the new tokens' positions: as given, or following the cache (an empty one: from 0)."""
        if self.positions is not None:
            return self.positions
        past = self.cache.length if self.cache is not None else 0
        return torch.arange(past, past + len(self.ids), device=device)


class Output:
    """A runner's result for one sequence: ``logits`` (1, n, V) and, when asked for, heads over
    each kept row's first ``cols`` logits: ``top`` = (probabilities, ids) host lists of the
    softmax top-k, ``choice`` = host list of argmax ids (the first on ties)."""

    __slots__ = ("logits", "top", "choice")

    def __init__(self, logits: torch.Tensor, top=None, choice=None):
        self.logits, self.top, self.choice = logits, top, choice


def with_heads(logits: torch.Tensor, topk: int = 0, argmax: bool = False, cols: int | None = None,
               perturb: Perturb | None = None) -> Output:
    """logits: (1, n, V) -> an Output with the heads asked for, computed after the forward (the
    runners that cannot fuse them into it: transformers, lean.py's torch path).  Host sync."""
    return heads_each(logits, [logits.shape[1]], topk, argmax, cols, [perturb])[0]


def heads_each(logits: torch.Tensor, keeps: list[int], topk: int = 0, argmax: bool = False,
               cols: int | None = None, perturbs: list | None = None) -> list[Output]:
    """logits: (1, K, V), several sequences' kept rows in turn (``keeps`` of them each) -> one
    Output per sequence, the heads of all rows read back at once (one host sync, not one per
    sequence: on a GPU each is a wait).  A sampled sequence's rows are perturbed in place first
    (their scores replace their logits, as in the C head)."""
    from .native import argmax_rows, topk_probs

    rows = logits[0, :, :cols] if cols is not None else logits[0]  # (K, cols)
    parts, r, widened = [], 0, False
    for k, perturb in zip(keeps, perturbs or [None] * len(keeps)):
        part = rows[r:r + k]
        if perturb is not None:
            noise = _noise_rows(perturb.noise(rows.shape[-1]), rows.device)  # (k, cols) float32
            if rows.dtype in (torch.float32, torch.float64):
                part.mul_(perturb.inv_temp).add_(noise.to(rows.dtype))
            else:  # scored in float32: noise rounded to 16 bits ties the top scores (bf16: ~5% of
                # draws at 50k tokens), and argmax would then take the lowest id -- a biased sample
                scores = part.float().mul_(perturb.inv_temp).add_(noise)
                part.copy_(scores)
                part, widened = scores, True
        parts.append(part)
        r += k
    if widened:  # the heads read the float32 scores
        rows = torch.cat([p.float() for p in parts])
    top = topk_probs(rows, topk) if topk else None
    choice = argmax_rows(rows) if argmax else None
    outs, r = [], 0
    for k in keeps:
        outs.append(Output(logits[:, r:r + k], (top[0][r:r + k], top[1][r:r + k]) if top else None,
                           choice[r:r + k] if choice is not None else None))
        r += k
    return outs


def _noise_rows(rows: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Kept rows' noise (host tensors; a tree's nodes at one depth share one) -> (n, width) on
    ``device``.  Off the CPU each distinct row crosses once: a 256-node tree over 50k tokens would
    otherwise copy ~51 MB per verification."""
    if device.type == "cpu":
        return torch.stack(rows)
    distinct, index = distinct_rows(rows)
    return torch.stack(distinct).to(device)[torch.tensor(index, device=device)]


def distinct_rows(rows: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """(the distinct rows in first-seen order, each row's place among them).  Rows are told apart
    by the memory they view, not by object: a Sampler hands out a fresh view of one noise row per
    call, and telling views apart by id() sent every node's copy (8x the bytes, 2026-11-29)."""
    slot: dict[tuple, int] = {}
    distinct: list[torch.Tensor] = []
    index = []
    for g in rows:
        key = (g.data_ptr(), g.numel(), g.stride(-1))
        if key not in slot:
            slot[key] = len(distinct)
            distinct.append(g)
        index.append(slot[key])
    return distinct, index


def seq_masks(seqs: list[Seq], dtype: torch.dtype, device: torch.device) -> list:
    """For a packed torch forward, per sequence: positions (1, n), and its SDPA mask over its cache
    and new tokens ((1, 1, n, P + n): additive from a KeyMask or as given; boolean causal; None for
    one token)."""
    out = []
    for s in seqs:
        n, past = len(s.ids), s.cache.length if s.cache is not None else 0
        pos = s.position_ids(device)
        mask = s.mask.additive(dtype) if isinstance(s.mask, KeyMask) else s.mask
        if mask is None and n > 1:  # causal over the new tokens, all of the cached prefix
            mask = torch.ones(n, past + n, dtype=torch.bool, device=device).tril(past)[None, None]
        out.append((pos.reshape(1, n).to(device), mask))
    return out


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(..., r) -> (-x2, x1), x = (x1, x2) split in halves: the rotary convention of GPT-NeoX and
    the Llama family (cos * x + sin * rotate_half(x) turns each pair (x1_i, x2_i) by its angle)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def row_spans(seqs: list[Seq]) -> list[tuple[int, int]]:
    """Each sequence's rows [lo, hi) in a packed forward's (1, N, .) activations."""
    spans, r = [], 0
    for s in seqs:
        spans.append((r, r + len(s.ids)))
        r += len(s.ids)
    return spans


def attend_each(q, k, v, seqs: list[Seq], spans, masks, layer: int, scale: float, gqa: bool = False):
    """A packed forward's attention: each sequence's new rows of q (1, Hq, N, hd) against its own
    cache of layer ``layer``, its new keys/values k, v (1, Hkv, N, hd) written into it first.
    Returns (1, Hq, N, hd)."""
    out = []
    for s, (lo, hi), (_, mask) in zip(seqs, spans, masks):
        ks, vs = k[:, :, lo:hi], v[:, :, lo:hi]
        if s.cache is not None:
            ks, vs = s.cache.layers[layer].update(ks, vs)  # (1, Hkv, P + n, hd)
        out.append(sdpa(q[:, :, lo:hi], ks, vs, mask, scale, gqa, expand=gqa and mask is not None and q.is_cuda))
    return out[0] if len(out) == 1 else torch.cat(out, dim=2)


def sdpa(q, k, v, mask, scale: float, gqa: bool, expand: bool = False) -> torch.Tensor:
    """SDPA of q (1, Hq, n, hd) over k, v (1, Hkv, P + n, hd).  ``expand``: grouped key/value heads
    repeated to q's first -- on CUDA, SDPA's fused kernels take grouped heads only without a mask
    and fall back to the math kernel with one, a float32 (Hq, n, P + n) score matrix per call (as
    transformers' sdpa_attention repeats them); on the CPU grouped heads with a mask measured
    1.3-19x faster than repeated ones, so they stay grouped there.  The same attention either way."""
    if expand:
        groups = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def kept_rows(h: torch.Tensor, seqs: list[Seq], spans) -> tuple[torch.Tensor, list[int]]:
    """h: (1, N, d) -> (1, K, d), only the rows whose logits each sequence keeps, and K per sequence."""
    kept = [(hi - min(s.keep, hi - lo) if s.keep else lo, hi) for s, (lo, hi) in zip(seqs, spans)]
    if len(seqs) > 1 or kept[0] != spans[0]:
        h = torch.cat([h[:, lo:hi] for lo, hi in kept], dim=1)
    return h, [hi - lo for lo, hi in kept]


def forward_each(runner, seqs: list[Seq], **heads) -> list[Output]:
    """Runner.forward for runners without a packed forward: one call per sequence."""
    outs = []
    for s in seqs:
        outs.append(runner(input_ids=s.ids[None], attention_mask=s.mask,
                           position_ids=None if s.positions is None else s.positions[None],
                           past_key_values=s.cache, use_cache=True, logits_to_keep=s.keep, perturb=s.perturb,
                           **heads))
    return outs
