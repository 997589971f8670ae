"""transformers' forward over several sequences at once, for the models no packed runner takes.

Each sequence keeps its own kvcache.BufferCache (the engine's per-row caches); one forward pads
them into a batch.  Layout of a group of B sequences, sequence b with P_b cached and n_b new tokens:

* queries: right-aligned in a (B, n) block, n = max n_b -- so every sequence's kept rows are the
  block's last ones and ``logits_to_keep`` cuts the LM head for all at once;
* keys: left-aligned in a (B, L) block, L = max (P_b + n_b) -- sequence b's cached keys, then its
  new ones, then zeros (never NaN: a masked score still multiplies them);
* one additive mask (B, 1, n, L): sequence b's own mask (its KeyMask, or causal) in its corner,
  padding query rows seeing key 0 only (their outputs are dropped; a row that sees nothing would
  turn its softmax to NaN).

The new keys and values go into each sequence's own cache exactly as a forward of that sequence
alone writes them (BufferLayer.append); the padded block is a per-layer copy that lives for one
attention call -- or, where the same sequences meet in consecutive forwards, their caches' storage
(:class:`_RowsLayer`'s modes), read in place.  Padding costs compute and the block memory, so sequences are grouped
(:func:`groups`): a forward pads at most PAD_SLACK x its real rows or PAD_FREE rows, whichever is
more, a layer's block and the mask stay under PAD_BYTES, and sequences on either side of a LongRoPE switch
never share a forward (:func:`rope_sides`); the rest take further forwards.
transformers' runner pads only where that copies nothing (:func:`in_place`: equal widths over
rows that share or adopt a block) and joins every other batch (joined.py: no padding, no copy).
A model whose padded forward parts from its sequences' own (models._batch_problems probes it at
load) joins every batch, or, where it cannot, runs one sequence per forward.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .runtime import KeyMask, Seq

# A group pads to at most PAD_SLACK x its real rows, or PAD_FREE rows: on a GPU a forward that small
# costs about one row's (the weights stream once); on a CPU padded rows cost compute, but on the
# bench pair (Zen 5, `--kernel hf`, B = 4 and 16) 8 rows or none (with 1.5x) measured the same
# within noise, so one rule serves both.
PAD_SLACK = 2.0
PAD_FREE = 64
PAD_BYTES = 512 * 2**20  # and one layer's padded keys and values, and the mask, stay under this
# A block the rows adopt holds each at the largest capacity among them: only while that is at most
# this many times their own capacities together (one long prompt among short ones would multiply
# the batch's cache memory)
ADOPT_SLACK = 1.5


def groups(seqs: list[Seq], token_bytes: int = 0, sides: list[int] | None = None,
           mask_bytes: int = 0) -> list[list[int]]:
    """Indices of ``seqs`` in forwards: the longest first, each group as wide as its padding allows.
    ``token_bytes``: one layer's key and value bytes per key slot; ``mask_bytes``: the mask's bytes
    per (query, key) entry -- a group's block and mask stay under PAD_BYTES (a batch of long prompts
    joining at once would otherwise build a (B, 1, n, L) mask of gigabytes); ``sides``: a forward
    takes sequences of one side only (:func:`rope_sides`)."""
    sides = sides or [0] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: (sides[i], -len(seqs[i].ids)))
    keys = [len(s.ids) + (s.cache.length if s.cache is not None else 0) for s in seqs]
    out: list[list[int]] = []
    for i in order:
        n = len(seqs[i].ids)
        if out and sides[out[-1][0]] == sides[i]:
            g = out[-1]
            width, real = len(seqs[g[0]].ids), sum(len(seqs[j].ids) for j in g) + n
            block = (len(g) + 1) * max(keys[j] for j in g + [i]) * (token_bytes + width * mask_bytes)
            if (len(g) + 1) * width <= max(PAD_SLACK * real, PAD_FREE) and block <= PAD_BYTES:
                g.append(i)
                continue
        out.append([i])
    return out


def rope_sides(seqs: list[Seq], switch: int | None) -> list[int] | None:
    """Per sequence, 1 if its largest position reaches a LongRoPE switch (names.rope_switch), else
    0; None without a switch.  transformers picks a forward's rotary table by its largest position
    over all rows, so a sequence below the switch beside one past it would read the long factors
    (the engine keeps each sequence's own forward on one side)."""
    if switch is None:
        return None
    return [int((int(s.positions.max()) if s.positions is not None else s.cache.length + len(s.ids) - 1) >= switch)
            for s in seqs]  # kept host syncs: positions, only for models with a switch


def token_bytes(seqs: list[Seq], dtype: torch.dtype) -> int:
    """One layer's key and value bytes per token in the padded block (``dtype``: the model's; a
    cache may store fewer), read off the first cache that holds any -- its first layer's (0 if none
    does: then the block holds the new tokens' keys alone, no more than the forward's own)."""
    for s in seqs:
        layer = s.cache.layers[0]
        if layer.is_initialized:
            k, v = layer.keys, layer.values  # (1, H, capacity, hd)
            return (k.shape[1] * k.shape[3] + v.shape[1] * v.shape[3]) * dtype.itemsize
    return 0


class _RowsLayer(DynamicLayer):
    """One decoder layer's view of the group's caches: ``update`` writes each sequence's new keys
    and values into its own cache and returns the padded (B, H, L, hd) block.

    ``mode``: "copy" builds the block afresh; "adopt" builds it with room for every row's
    capacity and makes it the rows' storage (each row's buffers become views of its block row,
    zero past its tokens), so the next forward of the same rows, "shared", reads the block in place
    and copies nothing."""

    def __init__(self, index: int, seqs: list[Seq], width: int, keys: int, mode: str):
        super().__init__()
        self.index, self.seqs, self.width, self.keys_len, self.mode = index, seqs, width, keys, mode
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        layers = [s.cache.layers[self.index] for s in self.seqs]
        ends = [layer.append(key_states[b:b + 1, :, self.width - len(s.ids):],
                             value_states[b:b + 1, :, self.width - len(s.ids):])
                for b, (s, layer) in enumerate(zip(self.seqs, layers))]
        if self.mode == "shared":
            kb, vb, _ = layers[0].block  # (B, H, capacity, hd) each
            return kb[:, :, :self.keys_len], vb[:, :, :self.keys_len]
        b_, h = key_states.shape[:2]  # (B, H, n, hd)
        cap = max([self.keys_len] + [layer.capacity for layer in layers]) if self.mode == "adopt" else self.keys_len
        k_out = key_states.new_empty((b_, h, cap, key_states.shape[-1]))  # (B, H, L or capacity, hd)
        v_out = value_states.new_empty((b_, h, cap, value_states.shape[-1]))
        for b, (layer, end) in enumerate(zip(layers, ends)):
            # what a lone forward reads: the cache's slots (rounded to its store dtype), widened here
            k_out[b, :, :end], v_out[b, :, :end] = layer.keys[0, :, :end], layer.values[0, :, :end]
            if end < cap:  # only the padding is zeroed (zero-filling the block: 4% of a step at B = 16)
                k_out[b, :, end:], v_out[b, :, end:] = 0, 0
            if self.mode == "adopt":
                layer.keys, layer.values = k_out[b:b + 1], v_out[b:b + 1]  # (1, H, capacity, hd) views
                layer.capacity, layer.block = cap, (k_out, v_out, b)
                self.seqs[b].cache._ptrs = None  # (the buffers moved: BufferCache.pointers reads them anew)
        return k_out[:, :, :self.keys_len], v_out[:, :, :self.keys_len]

    # group-wide sizes: transformers reads them to build masks and cache positions, and a padded
    # forward hands it every mask and position (forward_group), so no row reads them as its own
    def get_seq_length(self) -> int:
        return self.keys_len - self.width

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys_len, 0


class _RowsCache(Cache):
    """The Cache a padded forward hands transformers: one _RowsLayer per decoder layer."""

    def __init__(self, num_layers: int, seqs: list[Seq], width: int, keys: int, mode: str):
        super().__init__(layers=[_RowsLayer(i, seqs, width, keys, mode) for i in range(num_layers)])


def _mode(seqs: list[Seq], dtype: torch.dtype, seen: bool) -> str:
    """How a padded forward gets its block (_RowsLayer): "shared" where the rows' caches are one
    block's rows in this order, every layer, with room for the new tokens; else "adopt" where these
    rows also made up a forward of the last call (``seen``: rows that stay together), their caches
    hold the model's dtype and a block at their largest capacity costs at most ADOPT_SLACK x their
    own; else "copy"."""
    if _one_block(seqs) and all(s.cache.length + len(s.ids) <= s.cache.layers[0].capacity for s in seqs):
        return "shared"
    caps = [max(s.cache.layers[0].capacity, s.cache.length + len(s.ids)) for s in seqs]
    if (seen and all(s.cache.layers[0].store in (None, dtype) for s in seqs)
            and len(seqs) * max(caps) <= ADOPT_SLACK * sum(caps)):
        return "adopt"
    return "copy"


def in_place(runner, seqs: list[Seq]) -> list[tuple[list[int], str]] | None:
    """The padded forwards of ``seqs`` (:func:`plan`, for forward_padded) where they pad nothing and
    copy no cache -- their widths are equal, and every group reads a shared block or meets again
    and adopts one -- else None: transformers' runner joins them (joined.py), which copies nothing
    either -- and always where the model's attention is eager: transformers runs its softmax in
    float32, and over a padded block's keys a row's rounding differs from its own (~5e-7 of the
    logits on Gemma 2 in float64), where a joined row's attention is its own."""
    if runner.joined == "eager" or len({len(s.ids) for s in seqs}) > 1:
        return None
    forwards = plan(runner, seqs)
    return None if any(mode == "copy" for _, mode in forwards) else forwards


def _one_block(seqs: list[Seq]) -> bool:
    """Whether, in every layer, row b of one block of len(seqs) rows is sequence b's storage."""
    for i in range(len(seqs[0].cache.layers)):
        blocks = [s.cache.layers[i].block for s in seqs]
        if blocks[0] is None or blocks[0][0].shape[0] != len(seqs) or any(
                bl is None or bl[0] is not blocks[0][0] or bl[2] != b for b, bl in enumerate(blocks)):
            return False
    return True


def row_mask(runner, s: Seq, positions: torch.Tensor):
    """Sequence ``s``'s additive mask(s) over its cache and new tokens: (1, 1, n_b, P_b + n_b), or
    a dict per layer kind (models.HFRunner._additive)."""
    n, past = len(s.ids), s.cache.length
    mask = s.mask
    if mask is None:  # causal over the new tokens, all of the cache
        mask = KeyMask(past, torch.ones(n, n, dtype=torch.bool, device=runner.device).tril())
    return runner._additive(mask, {"position_ids": positions})


def _place(masks: list, width: int, keys: int, dtype, device) -> torch.Tensor:
    """Each sequence's (1, 1, n_b, K_b) additive mask in its corner of one (B, 1, n, L) mask."""
    low = torch.finfo(dtype).min
    out = torch.full((len(masks), 1, width, keys), low, dtype=dtype, device=device)
    for b, m in enumerate(masks):
        n, k = m.shape[-2:]
        out[b, 0, width - n:, :k] = m[0, 0]
        out[b, 0, :width - n, 0] = 0  # padding rows see key 0: a finite softmax, dropped anyway
    return out


def forward_group(runner, seqs: list[Seq], mode: str = "copy") -> list[torch.Tensor]:
    """One padded forward of ``seqs`` (its block by ``mode``: :func:`_mode`) -> each sequence's kept
    logits (1, keep_b, V)."""
    dev = runner.device
    width = max(len(s.ids) for s in seqs)
    keys = max(s.cache.length + len(s.ids) for s in seqs)
    ids = torch.zeros((len(seqs), width), dtype=torch.long, device=dev)  # (B, n)
    pos = torch.zeros((len(seqs), width), dtype=torch.long, device=dev)  # (B, n)
    masks = []
    for b, s in enumerate(seqs):
        n, p = len(s.ids), s.position_ids(dev)
        ids[b, width - n:], pos[b, width - n:] = s.ids, p
        masks.append(row_mask(runner, s, p))
    if isinstance(masks[0], dict):
        mask = {kind: _place([m[kind] for m in masks], width, keys, runner.dtype, dev) for kind in masks[0]}
    else:
        mask = _place(masks, width, keys, runner.dtype, dev)
    keeps = [s.kept for s in seqs]
    cache = _RowsCache(runner.config.num_hidden_layers, seqs, width, keys, mode)
    with runner.lock:  # (models.model_lock)
        logits = runner.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                              logits_to_keep=max(keeps), **{runner.cache_kw: cache}).logits  # (B, max keep, V)
    return [logits[b:b + 1, logits.shape[1] - k:] for b, k in enumerate(keeps)]


def forward_padded(runner, seqs: list[Seq], forwards: list[tuple[list[int], str]] | None = None
                   ) -> list[torch.Tensor]:
    """Each sequence's kept logits (1, keep_b, V), in ``seqs``' order, over the forwards of
    :func:`plan` (``forwards``: its result, where the caller has it: :func:`in_place`)."""
    out: list = [None] * len(seqs)
    forwards = forwards or plan(runner, seqs)
    runner.padded_groups = {tuple(id(seqs[i].cache) for i in g) for g, _ in forwards}
    for g, mode in forwards:
        for i, logits in zip(g, forward_group(runner, [seqs[i] for i in g], mode)):
            out[i] = logits
    return out


def plan(runner, seqs: list[Seq]) -> list[tuple[list[int], str]]:
    """The padded forwards of ``seqs``: :func:`groups` for ``runner``'s model, each in the callers'
    order (the same rows keep their block rows from call to call), with its block's :func:`_mode`
    (adopted where the same rows made up a forward of the last call: a reused id only costs an
    adoption)."""
    kinds = 2 if runner.mixed else 1  # (a mask per layer kind)
    met = getattr(runner, "padded_groups", ())
    out = []
    for g in groups(seqs, token_bytes(seqs, runner.dtype), rope_sides(seqs, runner.switch),
                    kinds * runner.dtype.itemsize):
        g = sorted(g)
        rows = [seqs[i] for i in g]
        out.append((g, _mode(rows, runner.dtype, tuple(id(s.cache) for s in rows) in met)))
    return out
