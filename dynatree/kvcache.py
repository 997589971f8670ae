"""A preallocated key/value cache that plugs into Hugging Face models and can keep a subset.

transformers' ``DynamicLayer`` grows by ``torch.cat`` on every forward (a full copy of the
cache each step).  :class:`BufferLayer` writes into a preallocated buffer instead and exposes
two operations the tree engine needs:

* ``crop``   — forget the last tokens (transformers 5.x convention: a negative count);
* ``keep``   — move a chosen set of slots (the accepted tree path) to the end of the committed
  prefix and drop everything after it: the accepted nodes' keys/values are kept as computed by
  the verification pass, with no second forward.

* ``evict``  — StreamingLLM's window (:class:`Window`): drop a run of old tokens after the
  attention sinks and move the rest down, re-rotating their keys to their new positions.

Buffers are (batch, heads, capacity, head_dim); they grow by doubling if a forward overruns.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer

from . import native
from .names import window_refusal
from .runtime import model_window, rotate_half


class BufferLayer(DynamicLayer):
    """One layer's keys and values; ``store`` (e.g. torch.bfloat16) keeps them in another dtype than
    the model computes in: written rounded, read back widened (``kv_dtype``)."""

    def __init__(self, capacity: int, store: torch.dtype | None = None):
        super().__init__()
        self.capacity = max(int(capacity), 1)
        self.length = 0
        self.store = store
        # padded.py: (keys, values, row) of the batch block whose row ``keys`` and ``values`` view, or None
        self.block = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        # uninitialised: no slot is read before it is written (forwards read slots < length), and
        # zero-filling a batch's caches cost ~10% of its prefill -- most tree slots are never touched
        self.keys = key_states.new_empty((b, h, self.capacity, d), dtype=self.store or key_states.dtype)
        self.values = value_states.new_empty((b, h, self.capacity, value_states.shape[-1]), dtype=self.keys.dtype)
        self.is_initialized = True

    def _grow(self, needed: int) -> None:
        new_cap = max(needed, 2 * self.capacity)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty(old.shape[:2] + (new_cap,) + old.shape[3:])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)
        self.capacity = new_cap
        self.block = None  # (its own buffers again)

    def append(self, key_states, value_states) -> int:
        """Write the new tokens' keys and values after the cached ones; returns the new length."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        end = self.length + q
        if end > self.capacity:
            self._grow(end)
        self.keys[:, :, self.length:end] = key_states  # rounded to the store dtype, if any
        self.values[:, :, self.length:end] = value_states
        self.length = end
        return end

    def update(self, key_states, value_states, *args, **kwargs):
        end = self.append(key_states, value_states)
        k, v = self.keys[:, :, :end], self.values[:, :, :end]
        if k.dtype != key_states.dtype:  # attention reads what the cache holds, widened
            k, v = k.to(key_states.dtype), v.to(value_states.dtype)
        return k, v

    def reserve(self, end: int, heads: int, head_dim: int, dtype, device) -> None:
        """Make slots up to ``end`` writable in place (lean.py's native forward writes them)."""
        if not self.is_initialized:
            empty = torch.empty((1, heads, 0, head_dim), dtype=dtype, device=device)
            self.lazy_initialization(empty, empty)
        if end > self.capacity:
            self._grow(end)

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count (transformers 5.x convention)")
        self.length = max(0, self.length + tokens_to_remove)

    def keep(self, start: int, src: torch.Tensor) -> None:
        """Move slots ``src`` (k,) int64 to ``start .. start+k-1`` and truncate there.

        ``src`` must be ascending with ``src[i] >= start + i`` (true for a BFS tree path), so the
        copy never reads a slot it already overwrote; advanced indexing copies first anyway.
        """
        k = src.shape[0]
        if not self.is_initialized:
            return
        self.keys[:, :, start:start + k] = self.keys[:, :, src]
        self.values[:, :, start:start + k] = self.values[:, :, src]
        self.length = start + k

    def evict(self, start: int, count: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Drop slots ``start .. start+count-1``; the later slots move down by ``count`` and their
        keys turn back by ``count`` positions: k' = k cos - rotate_half(k) sin on the first r dims.

        cos, sin: (r,) of ``count`` times the rotary frequencies.  The turn is computed in at
        least float32 (a 16-bit cache is rounded once per eviction, not at every product) into a
        fresh tensor before the write, so the overlapping move never reads a slot it already
        overwrote."""
        end = self.length
        if not self.is_initialized or end <= start + count:
            self.length = min(self.length, start)
            return
        r = cos.shape[-1]
        k = self.keys[:, :, start + count:end]  # (b, h, m, d)
        work = torch.promote_types(k.dtype, torch.float32)
        kr, cos, sin = k[..., :r].to(work), cos.to(work), sin.to(work)
        turned = (kr * cos - rotate_half(kr) * sin).to(k.dtype)
        self.keys[:, :, start:end - count] = torch.cat((turned, k[..., r:]), dim=-1)
        self.values[:, :, start:end - count] = self.values[:, :, start + count:end].clone()
        self.length = end - count

    def reset(self) -> None:
        self.length = 0


class BufferCache(Cache):
    """A transformers ``Cache`` made of :class:`BufferLayer`, one per decoder layer."""

    def __init__(self, num_layers: int, capacity: int, store: torch.dtype | None = None):
        super().__init__(layers=[BufferLayer(capacity, store) for _ in range(num_layers)])
        self._ptrs = None  # (first key buffer's address, key addresses, value addresses)
        # prefix.Shared: a copy of slots 0..n other caches share (prefix caching), which the native
        # kernel reads instead of these slots; dropped when they change
        self.shared = None

    def pointers(self):
        """The layers' key and value buffer addresses as the C kernels take them (native.py).

        Rebuilt only when the buffers move, which they do only when they grow, all at once."""
        first = self.layers[0].keys.data_ptr()
        if self._ptrs is None or self._ptrs[0] != first:
            self._ptrs = (first, *native.kv_pointers(self.layers))
        return self._ptrs[1], self._ptrs[2]

    @property
    def length(self) -> int:
        return self.layers[0].length

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value buffers (allocated capacity, not the cached length)."""
        return sum(l.keys.nbytes + l.values.nbytes for l in self.layers if l.is_initialized)

    def _unshare_from(self, slot: int) -> None:
        """Slots from ``slot`` on are about to change: a shared prefix reaching them is this
        cache's own again."""
        if self.shared is not None and slot < self.shared.length:
            self.shared.materialize(self)
            self.shared = None

    def own_slots(self) -> None:
        """Make the cache's own slots hold what it reads (before a forward that is not the native
        kernel's: those read no shared prefix)."""
        if self.shared is not None:
            self.shared.materialize(self)

    def crop(self, tokens_to_remove: int) -> None:
        for layer in self.layers:
            layer.crop(tokens_to_remove)
        self._unshare_from(self.length)

    def truncate(self, length: int) -> None:
        for layer in self.layers:
            layer.length = min(layer.length, length)
        self._unshare_from(self.length)

    def evict(self, start: int, count: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self._unshare_from(start)
        for layer in self.layers:
            layer.evict(start, count, cos, sin)

    def keep(self, start: int, slots: list[int]) -> None:
        """Keep cache slots ``slots`` (ascending host ints) at ``start ..`` and drop the rest.

        Slots that already sit at ``start ..`` (an accepted chain) need no copy, only a truncate.
        """
        if slots == list(range(start, start + len(slots))):
            self.truncate(start + len(slots))
            return
        self._unshare_from(start)
        layer0 = self.layers[0]
        if not layer0.is_initialized:
            return
        if native.cache_keep(self, start, slots):
            return
        src = torch.tensor(slots, device=layer0.keys.device)  # (k,)
        for layer in self.layers:
            layer.keep(start, src)


def new_cache(model, capacity: int, kv_dtype: str = "model") -> BufferCache:
    """A cache for ``model``; ``kv_dtype`` (config.KV_DTYPES) other than "model" names the torch
    dtype its keys and values are stored in."""
    return BufferCache(model.config.num_hidden_layers, capacity, None if kv_dtype == "model" else getattr(torch, kv_dtype))


@dataclass(frozen=True, eq=False)
class Window:
    """StreamingLLM's cache policy for one model (Xiao et al., "Efficient streaming language
    models with attention sinks"): the cache keeps the first ``sinks`` tokens and the most recent
    ones, at most ``size`` slots, and a token's position is its slot — so positions, memory and
    attention stay bounded however long the text.

    When a cache is full, the ``chunk`` oldest tokens after the sinks leave at once and the rest
    move down with their keys re-rotated (keys are cached after rotary).  Eviction happens only
    when a cache reaches ``size`` tokens, so the schedule depends on the token count alone, never
    on how many tokens an iteration commits: with trees kept inside the window (the engine clips
    their depth), every method computes each token against the same cache — greedy methods stay
    identical to ``ar`` with the same window.  Dropping a chunk rather than one token per step
    leaves speculation room to work between evictions."""

    size: int
    sinks: int
    chunk: int
    cos: torch.Tensor  # (r,) float64 cos(chunk * inv_freq), duplicated over the two halves as rotary does
    sin: torch.Tensor  # (r,) float64

    def make_room(self, cache: BufferCache, incoming: int) -> int:
        """Evict chunks until ``incoming`` more tokens fit (or only the sinks are left); returns
        the tokens evicted."""
        evicted = 0
        while cache.length + incoming > self.size and cache.length >= self.sinks + self.chunk:
            cache.evict(self.sinks, self.chunk, self.cos, self.sin)
            evicted += self.chunk
        return evicted


def make_window(model, size: int, sinks: int, chunk: int) -> Window:
    """A :class:`Window` for ``model`` (a transformers model with rotary position embeddings)."""
    cfg = model.config
    rotary = next((m for name, m in model.named_modules() if name.endswith("rotary_emb")), None)
    refusal = window_refusal(cfg, model_window(model))
    if refusal or rotary is None or not hasattr(rotary, "inv_freq"):
        raise ValueError(refusal or "kv_window needs a model with rotary positions (this one has no rotary_emb module "
                         "with inv_freq)")
    if getattr(rotary, "attention_scaling", 1.0) != 1.0:
        raise ValueError("kv_window does not support scaled rotary embeddings (rope_type "
                         f"{getattr(rotary, 'rope_type', '?')!r})")
    angle = chunk * rotary.inv_freq.to(torch.float64)  # (r/2,)
    angle = torch.cat((angle, angle))  # (r,)
    return Window(size, sinks, chunk, angle.cos(), angle.sin())
