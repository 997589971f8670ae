"""A lean GPT-NeoX forward (Pythia, the bench and demo pairs) over the model's own weights.

Why: at these sizes a transformers forward is mostly per-call machinery (mask building, cache
objects, module hooks), not arithmetic.  On this project's CPU a 2.5M-parameter draft forward
costs ~2 ms through transformers, which is what decides whether a tree level pays.  This module
runs the same math as ``GPTNeoXForCausalLM`` in a plain function (gpt-fast style): one fused
QKV matmul, partial rotary from a precomputed table, SDPA, parallel or sequential residual.

It is a drop-in for the engine: ``LeanNeoX(model)(input_ids=, attention_mask=, position_ids=,
past_key_values=BufferCache, logits_to_keep=)`` returns an object with ``.logits``; it shares
the model's parameters (no copy).  Tests check logits against transformers in float64 for
prefill, cached steps and tree masks.  Other architectures use transformers as before.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from . import gemm as gemm_mod


PACK_HINT = 64  # oneDNN packs for this many rows; measured flat-ish from 2 to 16 rows on this CPU


def can_pack(model) -> bool:
    """oneDNN-packed weights for multi-row forwards: CPU, float32, and weights big enough to be
    memory-bound (a 10 MB draft stays in cache and gets slower packed) yet small enough to keep a
    second copy (the 1-row path keeps the plain weights, which are faster there)."""
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
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
    def __init__(self, model, gemm: bool = True):
        """gemm: use dynatree's own few-row GEMM (gemm.py) where it applies, else torch's kernels."""
        cfg = model.config
        self.model, self.config = model, cfg
        self.dtype, self.device = model.dtype, model.device
        core = model.gpt_neox
        self.gemm = gemm and gemm_mod.usable(model)
        pack = can_pack(model) and not self.gemm

        def linear(w, b):
            return gemm_mod.PackedLinear(w, b) if self.gemm else Linear(w, b, pack)
        self.embed = core.embed_in.weight  # (V, d)
        self.final_ln = (core.final_layer_norm.weight, core.final_layer_norm.bias)
        self.lm_head = linear(model.lm_head.weight, None)  # d -> V
        self.eps = cfg.layer_norm_eps
        self.heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // self.heads
        self.parallel = cfg.use_parallel_residual
        self.act = core.layers[0].mlp.act
        self.scaling = core.layers[0].attention.scaling
        self.layers = [(
            (l.input_layernorm.weight, l.input_layernorm.bias),
            (l.post_attention_layernorm.weight, l.post_attention_layernorm.bias),
            *(linear(m.weight, m.bias) for m in (l.attention.query_key_value, l.attention.dense,
                                                        l.mlp.dense_h_to_4h, l.mlp.dense_4h_to_h)),
        ) for l in core.layers]
        # rotary table, computed as transformers does (float32 angles, cast to the model dtype)
        inv_freq = core.rotary_emb.inv_freq.to(self.device, torch.float)  # (r/2,)
        pos = torch.arange(cfg.max_position_embeddings, device=self.device, dtype=torch.float)
        freqs = pos[:, None] * inv_freq[None]
        emb = torch.cat((freqs, freqs), dim=-1)  # (max_pos, r)
        scale = core.rotary_emb.attention_scaling
        self.cos = (emb.cos() * scale).to(self.dtype)
        self.sin = (emb.sin() * scale).to(self.dtype)
        self.rot = emb.shape[-1]
        self.native = self.gemm and self.head_dim % 16 == 0 and self.head_dim <= 256 and cfg.hidden_size % 32 == 0
        if self.native:
            self._init_native(core)

    def _init_native(self, core) -> None:
        """Pointer tables for csrc/neox.c: one (NPARAM,) array per layer, dims once."""
        import ctypes

        d, ff = self.config.hidden_size, self.config.intermediate_size
        self.lib = gemm_mod.library()
        self.dims = torch.tensor([d, self.heads, self.head_dim, self.rot, ff, int(self.parallel)], dtype=torch.long)
        self.ptrs = []
        for (ln1, ln2, qkv, out, fc1, fc2), l in zip(self.layers, core.layers):
            assert all(m.n_pad == m.n_out for m in (qkv, out, fc1, fc2))
            ptrs = [t.data_ptr() for t in (*ln1, *ln2)]
            for m in (qkv, out, fc1, fc2):
                ptrs += [m.packed.data_ptr(), m.bias.data_ptr() if m.bias is not None else 0]
            self.ptrs.append((ctypes.c_void_p * len(ptrs))(*ptrs))
        self.work = torch.empty(0)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (1, H, n, hd); cos/sin: (1, 1, n, r) -> x with its first r dims rotated."""
        r = self.rot
        xr, xp = x[..., :r], x[..., r:]
        half = r // 2
        rotated = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
        return torch.cat((xr * cos + rotated * sin, xp), dim=-1)

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, past_key_values=None, use_cache: bool = True,
                 logits_to_keep: int = 0):
        """input_ids: (1, n); attention_mask: additive (1, 1, n, P + n) or None (causal);
        position_ids: (1, n) or None (P .. P+n-1); past_key_values: a BufferCache holding P tokens.
        Returns ``.logits`` (1, n or logits_to_keep, V)."""
        n = input_ids.shape[1]
        cache = past_key_values
        past = cache.length if cache is not None else 0
        if self.native and cache is not None:
            return self._native(input_ids, attention_mask, position_ids, cache, past, logits_to_keep)
        if position_ids is None:
            position_ids = torch.arange(past, past + n, device=self.device)[None]
        cos = self.cos[position_ids][:, None]  # (1, 1, n, r)
        sin = self.sin[position_ids][:, None]
        mask = attention_mask
        if mask is None and n > 1:  # causal over the new tokens, all of the cached prefix
            allowed = torch.ones(n, past + n, dtype=torch.bool, device=self.device).tril(past)
            mask = allowed[None, None]
        h = F.embedding(input_ids, self.embed)  # (1, n, d)
        H, hd = self.heads, self.head_dim
        for i, (ln1, ln2, qkv_w, out_w, fc1, fc2) in enumerate(self.layers):
            x = F.layer_norm(h, h.shape[-1:], ln1[0], ln1[1], self.eps)
            qkv = qkv_w(x).view(1, n, H, 3 * hd).transpose(1, 2)  # (1, H, n, 3hd)
            q, k, v = qkv.chunk(3, dim=-1)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            if cache is not None:
                k, v = cache.layers[i].update(k, v)  # (1, H, P + n, hd)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling)
            a = out_w(a.transpose(1, 2).reshape(1, n, H * hd))
            if self.parallel:
                y = F.layer_norm(h, h.shape[-1:], ln2[0], ln2[1], self.eps)
                h = fc2(self.act(fc1(y))) + a + h
            else:
                a = a + h
                y = F.layer_norm(a, a.shape[-1:], ln2[0], ln2[1], self.eps)
                h = fc2(self.act(fc1(y))) + a
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        h = F.layer_norm(h, h.shape[-1:], self.final_ln[0], self.final_ln[1], self.eps)
        return SimpleNamespace(logits=self.lm_head(h))


    def _native(self, input_ids, attention_mask, position_ids, cache, past, logits_to_keep):
        """The same forward through csrc/neox.c: two C calls and a torch activation per layer."""
        n = input_ids.shape[1]
        end = past + n
        d, ff = self.config.hidden_size, self.config.intermediate_size
        if position_ids is None:
            position_ids = torch.arange(past, end)
        pos = position_ids.reshape(-1).to(torch.long).contiguous()  # (n,)
        allowed = None
        if attention_mask is not None:  # additive (1, 1, n, end): 0 where a key is visible
            allowed = (attention_mask.reshape(n, end) == 0).contiguous()  # (n, end) bool
        if self.work.numel() < 5 * n * d:
            self.work = torch.empty(5 * n * d)
        h = F.embedding(input_ids[0], self.embed)  # (n, d)
        a, z, out = torch.empty(n, d), torch.empty(n, ff), torch.empty(n, d)
        threads = torch.get_num_threads()
        lib, eps, dims = self.lib, self.eps, self.dims.data_ptr()
        for i, layer in enumerate(cache.layers):
            layer.reserve(end, self.heads, self.head_dim, self.dtype, self.device)
            lib.dt_neox_block_in(dims, eps, self.scaling, self.ptrs[i], n, h.data_ptr(), pos.data_ptr(),
                                 self.cos.data_ptr(), self.sin.data_ptr(), layer.keys.data_ptr(),
                                 layer.values.data_ptr(), layer.capacity, past,
                                 allowed.data_ptr() if allowed is not None else None, a.data_ptr(), z.data_ptr(),
                                 self.work.data_ptr(), threads)
            g = self.act(z).contiguous()
            lib.dt_neox_block_out(dims, self.ptrs[i], n, g.data_ptr(), a.data_ptr(), h.data_ptr(), out.data_ptr(),
                                  threads)
            layer.length = end
            h, out = out, h
        if logits_to_keep:
            h = h[-logits_to_keep:].contiguous()
        y = torch.empty_like(h)
        lib.dt_layer_norm(h.data_ptr(), h.shape[0], d, self.final_ln[0].data_ptr(), self.final_ln[1].data_ptr(),
                          self.eps, y.data_ptr())
        return SimpleNamespace(logits=self.lm_head(y)[None])


def lean(model, gemm: bool = True):
    """The lean forward for a supported model, else the model itself."""
    return LeanNeoX(model, gemm) if model is not None and supports(model) else model
