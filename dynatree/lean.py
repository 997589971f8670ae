"""A lean GPT-NeoX forward (Pythia, the bench and demo pairs) over the model's own weights.

Why: at these sizes a transformers forward is mostly per-call machinery (mask building, cache
objects, module hooks), not arithmetic.  On this project's CPU a 2.5M-parameter draft forward
costs ~2 ms through transformers, which is what decides whether a tree level pays.  This module
runs the same math as ``GPTNeoXForCausalLM`` in a plain function (gpt-fast style): one fused
QKV matmul, partial rotary from a precomputed table, SDPA, parallel or sequential residual.

It is a drop-in for the engine: ``LeanNeoX(model)(input_ids=, attention_mask=, position_ids=,
past_key_values=BufferCache, logits_to_keep=)`` returns an object with ``.logits``; it shares
the model's parameters (no copy).  Tests check logits against transformers in float64 for
prefill, cached steps and tree masks.  Llama-family models take packed.py; other
architectures, transformers' forward (models.HFRunner).

Two paths run that math.  On a float32 CPU model whose shapes the C kernels take, every cached
forward of up to ``NATIVE_ROWS`` tokens, and every masked one, is one call into csrc/neox.c
(native.py; batch invariant, so tree logits are bitwise AR logits).  Everything else — other
dtypes and devices, no C compiler, ``--kernel lean-mkl``, long causal prefills — runs the torch
ops below.
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from . import native
from .runtime import (KeyMask, Output, Seq, attend_each, forward_each, heads_each, kept_rows, rotate_half, row_spans,
                      seq_masks)


NATIVE_ROWS = 512  # causal forwards above this many rows (long prefills) take torch's GEMMs: the C
# kernel's work buffer and per-row attention grow with n; up to here it prefills ~10% faster than MKL
# (200-token prompt on the bench pair: 77-81 ms vs 86-91 ms median)
PACK_HINT = 64  # oneDNN packs for this many rows; measured flat-ish from 2 to 16 rows on this CPU


def can_pack(model) -> bool:
    """oneDNN-packed weights for multi-row forwards: CPU, float32, and weights big enough to be
    memory-bound (a 10 MB draft stays in cache and gets slower packed) yet small enough to keep a
    second copy (the 1-row path keeps the plain weights, which are faster there)."""
    n_bytes = native.param_bytes(model)
    return (model.device.type == "cpu" and model.dtype == torch.float32 and 32 * 2**20 <= n_bytes <= 2 * 2**30
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class Linear:
    """``y = x W^T + b`` with the faster CPU kernel for the row count.

    One row (ar steps, single-node draft levels) is memory-bound: MKL's GEMV over the plain
    weights (kept in (in, out) layout, see models.cpu_layout) streams them once and wins.  Two or
    more rows (tree verification, wide draft levels) go through oneDNN with weights packed once
    at load: on this project's CPU, six layers' worth of 512x2048 matmuls cost 6.7 ms for 4 rows
    and 10.8 ms for 16 rows packed, against 11.0 and 15.5 ms unpacked.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool):
        self.weight, self.bias = weight, bias
        self.packed = (torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_HINT)
                       if pack else None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: (1, n, in) -> (1, n, out)."""
        if self.packed is None or x.shape[1] == 1:
            return F.linear(x, self.weight, self.bias)
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), self.packed, self.bias,
                                               "none", [], "")
        return y.view(*x.shape[:-1], -1)


def supports(model) -> bool:
    cfg = getattr(model, "config", None)
    if getattr(cfg, "model_type", None) != "gpt_neox":
        return False
    rope = getattr(cfg, "rope_parameters", None) or {}
    return rope.get("rope_type", "default") == "default" and cfg.hidden_act in ("gelu", "gelu_new", "relu")


class LeanNeoX:
    def __init__(self, model, gemm: bool = True, isa: str | None = None):
        """gemm: run cached forwards through csrc/neox.c (native.py) where it applies, else torch;
        isa: the kernel variant (default: native.variant(), i.e. $DYNATREE_ISA or native)."""
        cfg = model.config
        self.model, self.config = model, cfg
        self.dtype, self.device = model.dtype, model.device
        core = model.gpt_neox
        self.embed = core.embed_in.weight  # (V, d)
        self.final_ln = (core.final_layer_norm.weight, core.final_layer_norm.bias)
        self.eps = cfg.layer_norm_eps
        self.heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // self.heads
        self.parallel = cfg.use_parallel_residual
        self.act = core.layers[0].mlp.act
        self.scaling = core.layers[0].attention.scaling
        # rotary table, computed as transformers does (float32 angles, cast to the model dtype)
        inv_freq = core.rotary_emb.inv_freq.to(self.device, torch.float)  # (r/2,)
        pos = torch.arange(cfg.max_position_embeddings, device=self.device, dtype=torch.float)
        freqs = pos[:, None] * inv_freq[None]
        emb = torch.cat((freqs, freqs), dim=-1)  # (max_pos, r)
        scale = core.rotary_emb.attention_scaling
        self.cos = (emb.cos() * scale).to(self.dtype)
        self.sin = (emb.sin() * scale).to(self.dtype)
        self.rot = emb.shape[-1]
        self.native = (gemm and cfg.hidden_act in ("gelu", "relu")
                       and cfg.hidden_size % 32 == 0 and cfg.intermediate_size % 32 == 0
                       and native.usable(model, isa) and native.library(isa).dt_attn_supported(self.head_dim))
        # The torch path serves everything when not native, and long causal prefills when native
        # (many rows: MKL's GEMM wins there, and a prompt is prefilled the same way by every method).
        pack = can_pack(model) and not self.native
        self.lm_head = Linear(model.lm_head.weight, None, pack)  # d -> V
        self.layers = [(
            (l.input_layernorm.weight, l.input_layernorm.bias),
            (l.post_attention_layernorm.weight, l.post_attention_layernorm.bias),
            *(Linear(m.weight, m.bias, pack) for m in (l.attention.query_key_value, l.attention.dense,
                                                       l.mlp.dense_h_to_4h, l.mlp.dense_4h_to_h)),
        ) for l in core.layers]
        if self.native:
            self._init_native(core, native.library(isa))

    def _init_native(self, core, lib) -> None:
        """Packed weights and the pointer table csrc/neox.c reads (NPARAM per layer, in its order)."""
        cfg = self.config
        self.lib = lib
        mats = [self.model.lm_head.weight] + [m.weight for l in core.layers for m in (
            l.attention.query_key_value, l.attention.dense, l.mlp.dense_h_to_4h, l.mlp.dense_4h_to_h)]
        self.weight_format = fmt = native.weight_format(mats)
        head = native.PackedLinear(self.model.lm_head.weight, None, fmt, lib)
        self.n_vocab, self.vocab_pad = head.n_out, head.n_pad
        act = {"gelu": 1, "relu": 2}[cfg.hidden_act]
        self.dims = torch.tensor([cfg.hidden_size, self.heads, self.head_dim, self.rot, cfg.intermediate_size,
                                  int(self.parallel), act, self.vocab_pad, self.embed.shape[0], fmt],
                                 dtype=torch.long)
        self.packed, ptrs = [head], []
        for l in core.layers:
            ptrs += [t.data_ptr() for t in (l.input_layernorm.weight, l.input_layernorm.bias,
                                            l.post_attention_layernorm.weight, l.post_attention_layernorm.bias)]
            for m in (l.attention.query_key_value, l.attention.dense, l.mlp.dense_h_to_4h, l.mlp.dense_4h_to_h):
                pm = native.PackedLinear(m.weight, m.bias, fmt, lib)
                self.packed.append(pm)
                ptrs += [pm.packed.data_ptr(), pm.bias.data_ptr() if pm.bias is not None else 0]
        self.ptrs = (ctypes.c_void_p * len(ptrs))(*ptrs)
        self.head_ptrs = (ctypes.c_void_p * 3)(self.final_ln[0].data_ptr(), self.final_ln[1].data_ptr(),
                                               head.packed.data_ptr())
        self.work = torch.empty(0)
        # plain ints and addresses, looked up once: the call above runs a few thousand times a second
        self.work_per_row = 8 * cfg.hidden_size + cfg.intermediate_size
        self.n_layers = len(core.layers)
        self.dims_ptr, self.embed_ptr = self.dims.data_ptr(), self.embed.data_ptr()
        self.cos_ptr, self.sin_ptr = self.cos.data_ptr(), self.sin.data_ptr()

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (1, H, n, hd); cos/sin: (1, 1, n, r) -> x with its first r dims rotated."""
        r = self.rot
        xr, xp = x[..., :r], x[..., r:]
        return torch.cat((xr * cos + rotate_half(xr) * sin, xp), dim=-1)

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, past_key_values=None, use_cache: bool = True,
                 logits_to_keep: int = 0, topk: int = 0, argmax: bool = False, cols: int | None = None,
                 perturb=None):
        """input_ids: (1, n); attention_mask: a KeyMask, additive (1, 1, n, P + n) or None (causal);
        position_ids: (1, n) or None (P .. P+n-1); past_key_values: a BufferCache holding P tokens.
        Returns a runtime.Output: ``.logits`` (1, n or logits_to_keep, V), and the softmax top-k
        (``topk``) or argmax (``argmax``) of each kept row's first ``cols`` logits, host lists."""
        cache = past_key_values
        native_ = self._takes(input_ids.shape[1], attention_mask, cache)
        if native_ and attention_mask is not None and not isinstance(attention_mask, KeyMask):
            attention_mask = KeyMask.from_additive(attention_mask)  # additive (1, 1, n, P + n)
        seq = Seq(input_ids.reshape(-1), cache, None if position_ids is None else position_ids.reshape(-1),
                  attention_mask, logits_to_keep, perturb)
        return (self._native if native_ else self._torch)([seq], topk, argmax, cols)[0]

    def forward(self, seqs: list[Seq], topk: int = 0, argmax: bool = False, cols: int | None = None) -> list[Output]:
        """Several sequences' new tokens -> one Output each (runtime.py), in one packed forward:
        every row in one pass over the weights, each attending to its own cache.  The native
        kernel's is bitwise what each row would get alone; the torch one's GEMMs span all rows
        (exact in float64; in float32 and lower a row's rounding may depend on its neighbours)."""
        if all(self._takes(len(s.ids), s.mask, s.cache) for s in seqs):
            return self._native(seqs, topk, argmax, cols)
        if self.native:  # a long prefill beside native rows: each takes its own path
            return forward_each(self, seqs, topk=topk, argmax=argmax, cols=cols)
        return self._torch(seqs, topk, argmax, cols)

    def _takes(self, n: int, mask, cache) -> bool:
        """Whether the native kernel runs this forward (masked, or causal up to NATIVE_ROWS rows,
        into a cache whose element type it reads)."""
        return (self.native and cache is not None and (mask is not None or n <= NATIVE_ROWS)
                and (getattr(cache.layers[0], "store", None) or torch.float32) in native.KV_FORMATS)

    def _torch(self, seqs: list[Seq], topk: int, argmax: bool, cols: int | None) -> list[Output]:
        """The packed forward as torch ops (MKL/oneDNN on a CPU; any dtype and device): the GEMMs
        over every sequence's rows at once, attention per sequence over its own cache."""
        spans = row_spans(seqs)
        masks = seq_masks(seqs, self.dtype, self.device)
        pos = torch.cat([p for p, _ in masks], dim=1)  # (1, N)
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # (1, 1, N, r)
        h = F.embedding(torch.cat([s.ids.reshape(-1) for s in seqs])[None].to(self.device), self.embed)  # (1, N, d)
        H, hd, N = self.heads, self.head_dim, spans[-1][1]
        for i, (ln1, ln2, qkv_w, out_w, fc1, fc2) in enumerate(self.layers):
            x = F.layer_norm(h, h.shape[-1:], ln1[0], ln1[1], self.eps)
            qkv = qkv_w(x).view(1, N, H, 3 * hd).transpose(1, 2)  # (1, H, N, 3hd)
            q, k, v = qkv.chunk(3, dim=-1)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            a = attend_each(q, k, v, seqs, spans, masks, i, self.scaling)  # (1, H, N, hd)
            a = out_w(a.transpose(1, 2).reshape(1, N, H * hd))
            if self.parallel:
                y = F.layer_norm(h, h.shape[-1:], ln2[0], ln2[1], self.eps)
                h = fc2(self.act(fc1(y))) + a + h
            else:
                a = a + h
                y = F.layer_norm(a, a.shape[-1:], ln2[0], ln2[1], self.eps)
                h = fc2(self.act(fc1(y))) + a
        h, keeps = kept_rows(h, seqs, spans)  # (1, K, d): only the logits asked for
        h = F.layer_norm(h, h.shape[-1:], self.final_ln[0], self.final_ln[1], self.eps)
        return heads_each(self.lm_head(h), keeps, topk, argmax, cols, [s.perturb for s in seqs])  # (1, K, V)

    def _native(self, seqs: list[Seq], topk: int, argmax: bool, cols: int | None) -> list[Output]:
        """The sequences' forward as one call into csrc/neox.c (batch invariant: see that file).

        Lean on purpose: a draft forward is ~0.1 ms of C, so every microsecond of Python here shows."""
        descs = (native.DtSeq * len(seqs))()
        ids, pos, alive, kept = [], [], [], 0
        cols = self.n_vocab if cols is None else min(cols, self.n_vocab)
        for d, s in zip(descs, seqs):
            n, cache = len(s.ids), s.cache
            past = cache.length
            end = past + n
            keep = min(s.keep, n) if s.keep else n
            ids.append(s.ids)
            pos.append(s.positions)
            if s.mask is not None:
                allowed = s.mask.allowed if s.mask.allowed.is_contiguous() else s.mask.allowed.contiguous()
                if allowed.shape != (n, end - s.mask.visible):
                    raise ValueError(f"mask covers {tuple(allowed.shape)} keys, expected {(n, end - s.mask.visible)}")
                alive.append(allowed)
                d.visible, d.allowed = s.mask.visible, allowed.data_ptr()
            layers = cache.layers
            if not layers[0].is_initialized or end > layers[0].capacity:
                for layer in layers:
                    layer.reserve(end, self.heads, self.head_dim, self.dtype, self.device)
            kc, vc = cache.pointers()
            d.kc, d.vc = ctypes.addressof(kc), ctypes.addressof(vc)
            alive.append((kc, vc))
            d.rows, d.past, d.cap, d.keep = n, past, layers[0].capacity, keep
            d.kvfmt = native.KV_FORMATS[layers[0].keys.dtype]
            if s.perturb is not None:  # sampling's heads: one noise row per kept row
                noise = [g if g.dtype == torch.float32 else g.float() for g in s.perturb.noise(cols)]
                rows = (ctypes.c_void_p * keep)(*[g.data_ptr() for g in noise])
                alive.append((noise, rows))
                d.noise, d.inv_temp = ctypes.addressof(rows), s.perturb.inv_temp
            kept += keep
        ids = ids[0] if len(ids) == 1 else torch.cat(ids)  # (n,)
        if ids.dtype != torch.long or not ids.is_contiguous():
            ids = ids.long().contiguous()
        n = ids.shape[0]
        if all(p is None for p in pos):
            pos = None  # consecutive positions past.. are computed in C
        else:
            pos = torch.cat([p.long() if p is not None else torch.arange(s.cache.length, s.cache.length + len(s.ids))
                             for p, s in zip(pos, seqs)]).contiguous()  # (n,)
        if self.work.numel() < n * self.work_per_row:
            self.work = torch.empty(n * self.work_per_row)
        logits = torch.empty(kept, self.vocab_pad)  # (sum keep, V_pad)
        vals = top = None
        mode = 0
        if topk:
            mode = k = min(topk, cols)
            vals, top = torch.empty(kept, k), torch.empty(kept, k, dtype=torch.long)  # (sum keep, k)
        elif argmax:
            mode, top = -1, torch.empty(kept, dtype=torch.long)  # (sum keep,)
        bad = self.lib.dt_neox_forward(
            self.dims_ptr, self.eps, self.scaling, self.n_layers, self.ptrs, self.embed_ptr, self.head_ptrs,
            ids.data_ptr(), n, pos.data_ptr() if pos is not None else None, self.cos_ptr, self.sin_ptr,
            descs, len(seqs), logits.data_ptr(), self.work.data_ptr(), torch.get_num_threads(), cols, mode,
            vals.data_ptr() if vals is not None else None, top.data_ptr() if top is not None else None)
        if bad:
            raise IndexError(f"token id outside the embedding (0 .. {self.embed.shape[0] - 1})")
        for d, s in zip(descs, seqs):
            for layer in s.cache.layers:
                layer.length = d.past + d.rows
        if self.vocab_pad != self.n_vocab:
            logits = logits[:, :self.n_vocab]
        # host sync (heads): the caller shapes a tree from these, or accepts the target's choices
        heads = vals.tolist() if mode > 0 else None, top.tolist() if mode else None
        outs, r = [], 0
        for d in descs:
            lg = logits[r:r + d.keep][None]  # (1, keep, V)
            if mode > 0:
                outs.append(Output(lg, (heads[0][r:r + d.keep], heads[1][r:r + d.keep])))
            elif mode < 0:
                outs.append(Output(lg, choice=heads[1][r:r + d.keep]))
            else:
                outs.append(Output(lg))
            r += d.keep
        return outs


def lean(model, gemm: bool = True):
    """The lean forward for a supported model, else the model itself."""
    return LeanNeoX(model, gemm) if model is not None and supports(model) else model
