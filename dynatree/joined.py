"""transformers' forward over several sequences joined into one, attention per sequence.

The padded forward (padded.py) pads every sequence of a group to the widest one's new tokens, so
where widths differ -- a batch of token trees beside bare roots -- most of its linear layers'
work is padding.  Here the sequences' new tokens are laid end to end in one (1, N) row, N = the
sum of their widths, so the linear layers see real tokens only (as the native kernel's packed
forward does), and attention, the one place sequences must stay apart, runs per sequence through
a registered attention function (transformers' AttentionInterface):

* for sequence b, queries ``query[:, :, o_b:o_b + n_b]`` against its own cache's keys and values,
  read in place (its BufferCache, the new keys appended by :class:`_JoinedLayer` exactly as a
  forward of b alone appends them), under b's own mask (its KeyMask or causal, with the model's
  sliding window; one per layer kind where layers differ);
* through the model's own attention function -- transformers' SDPA one, or its modeling file's
  ``eager_attention_forward`` (softcaps, sinks) -- so each sequence's attention is the call its lone
  forward makes, on the same shapes.

The model's ``_attn_implementation`` names :data:`NAME` only for the duration of such a forward
(transformers builds no mask for an implementation it has no mask function for, and positions come
in explicitly).  Sequences on either side of a LongRoPE switch take separate forwards (transformers
picks one rotary table per forward), and the sequences' masks together stay under
padded.PAD_BYTES per forward.  A load-time probe (models._batch_problems) checks each model's
joined forward against its sequences' own.
"""
from __future__ import annotations

import contextvars
import itertools
import sys
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .padded import PAD_BYTES, row_mask, rope_sides
from .runtime import Seq

NAME = "dynatree_joined"
INNER = ("sdpa", "eager")  # the model implementations a joined forward runs per sequence


@dataclass(frozen=True)
class _Join:
    """One joined forward's layout, read by :func:`_attention` in every layer."""

    seqs: list  # runtime.Seq, in the row's order
    offsets: list  # o_b: where sequence b's new tokens start in the row
    masks: list  # per sequence: an additive (1, 1, n_b, K_b) mask, a dict per layer kind, or None
    kinds: list | None  # config.layer_types (the mask each layer reads), or None: one mask
    inner: str  # the model's own implementation: "sdpa" or "eager"


_JOIN: contextvars.ContextVar[_Join | None] = contextvars.ContextVar("dynatree_join", default=None)


def _attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention interface for a joined forward: query (1, H, N, hd) -> (1, N, H, hd),
    each sequence's queries against its own cache (``key``/``value``, the row's new keys, are
    already in the caches)."""
    join = _JOIN.get()
    if join is None:
        raise RuntimeError(f"attention implementation {NAME!r} runs only inside dynatree's joined forward")
    inner = sdpa_attention_forward if join.inner == "sdpa" else sys.modules[type(module).__module__].eager_attention_forward
    i = module.layer_idx
    kind = join.kinds[i] if join.kinds else None
    outs = []
    for s, o, m in zip(join.seqs, join.offsets, join.masks):
        layer = s.cache.layers[i]
        k, v = layer.keys[:, :, :layer.length], layer.values[:, :, :layer.length]  # (1, Hkv, K_b, hd) views
        if k.dtype != query.dtype:  # what a lone forward reads (BufferLayer.update): widened
            k, v = k.to(query.dtype), v.to(query.dtype)
        mask = m[kind] if isinstance(m, dict) else m
        outs.append(inner(module, query[:, :, o:o + len(s.ids)], k, v, mask, **kwargs)[0])  # (1, n_b, H, hd)
    return torch.cat(outs, dim=1), None


AttentionInterface.register(NAME, _attention)


class _JoinedLayer(DynamicLayer):
    """One decoder layer's view of the joined sequences' caches: ``update`` appends each one's new
    keys and values to its own cache (attention reads them there)."""

    def __init__(self, index: int, seqs: list[Seq], offsets: list[int]):
        super().__init__()
        self.index, self.seqs, self.offsets = index, seqs, offsets
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):  # (1, Hkv, N, hd) each
        for s, o in zip(self.seqs, self.offsets):
            n = len(s.ids)
            s.cache.layers[self.index].append(key_states[:, :, o:o + n], value_states[:, :, o:o + n])
        return key_states, value_states

    # no row's sizes: every mask and position is handed in (forward_join)
    def get_seq_length(self) -> int:
        return 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0


class _JoinedCache(Cache):
    def __init__(self, num_layers: int, seqs: list[Seq], offsets: list[int]):
        super().__init__(layers=[_JoinedLayer(i, seqs, offsets) for i in range(num_layers)])


def inner_implementation(model) -> str | None:
    """The model's attention implementation if a joined forward can run it per sequence, else None."""
    impl = model.config._attn_implementation
    return impl if impl in INNER else None


def _mask(runner, s: Seq, positions: torch.Tensor):
    """Sequence ``s``'s mask(s) (padded.row_mask), or None for one token that sees its whole
    cache (SDPA and eager attention alike take no mask as "every key")."""
    if len(s.ids) == 1 and s.mask is None and runner.window is None:
        return None
    return row_mask(runner, s, positions)


def forward_join(runner, seqs: list[Seq]) -> list[torch.Tensor]:
    """One joined forward of ``seqs`` -> each sequence's kept logits (1, keep_b, V)."""
    dev, widths = runner.device, [len(s.ids) for s in seqs]
    offsets = [0, *itertools.accumulate(widths)][:-1]  # o_b
    pos = torch.cat([s.position_ids(dev) for s in seqs])
    masks = [_mask(runner, s, p) for s, p in zip(seqs, pos.split(widths))]
    keeps = [s.kept for s in seqs]
    rows = torch.cat([torch.arange(o + n - k, o + n, device=dev) for o, n, k in zip(offsets, widths, keeps)])
    kinds = list(runner.config.layer_types) if runner.mixed else None
    cfg = runner.model.config
    with runner.lock:  # (models.model_lock: no forward of this model in another thread reads the name)
        token = _JOIN.set(_Join(seqs, offsets, masks, kinds, runner.joined))
        cfg._attn_implementation = NAME  # (this forward only: transformers reads it in every attention layer)
        try:
            logits = runner.model(input_ids=torch.cat([s.ids for s in seqs])[None], position_ids=pos[None],
                                  use_cache=True, logits_to_keep=rows,
                                  **{runner.cache_kw: _JoinedCache(runner.config.num_hidden_layers, seqs,
                                                                   offsets)}).logits
        finally:
            cfg._attn_implementation = runner.joined
            _JOIN.reset(token)
    return list(logits.split(keeps, dim=1))  # (1, keep_b, V) each


def parts(seqs: list[Seq], sides: list[int] | None, mask_bytes: int) -> list[list[int]]:
    """Indices of ``seqs`` in joined forwards, in order: one per LongRoPE side (:func:`padded.rope_sides`),
    each holding masks of at most PAD_BYTES together (``mask_bytes`` per (query, key) entry; a
    single token's mask is None, :func:`_mask`) -- a batch of long prompts joining at once would
    otherwise hold all their masks at once."""
    sides = sides or [0] * len(seqs)
    out: dict[int, list] = {}  # side -> [[indices, mask bytes], ...]
    for i, s in enumerate(seqs):
        n = len(s.ids)
        size = n * (n + s.cache.length) * mask_bytes if n > 1 else 0
        chunks = out.setdefault(sides[i], [[[], 0]])
        if chunks[-1][0] and chunks[-1][1] + size > PAD_BYTES:
            chunks.append([[], 0])
        chunks[-1][0].append(i)
        chunks[-1][1] += size
    return [c[0] for side in sorted(out) for c in out[side]]


def forward_joined(runner, seqs: list[Seq]) -> list[torch.Tensor]:
    """Each sequence's kept logits (1, keep_b, V), in ``seqs``' order, over :func:`parts`' forwards."""
    out: list = [None] * len(seqs)
    kinds = 2 if runner.mixed else 1
    split = parts(seqs, rope_sides(seqs, runner.switch), kinds * runner.dtype.itemsize)
    # the rows of a joined forward count as met for padded.forward_padded's next call, so a tree
    # step between plain ones does not cost the plain ones their shared block
    runner.padded_groups = {tuple(id(seqs[i].cache) for i in part) for part in split}
    for part in split:
        for i, logits in zip(part, forward_join(runner, [seqs[i] for i in part])):
            out[i] = logits
    return out
