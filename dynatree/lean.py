"""A lean GPT-NeoX forward (Pythia, the bench and demo pairs) over the model's own weights.

Why: at these sizes a transformers forward is mostly per-call machinery (mask building, cache
objects, module hooks), not arithmetic.  On this project's CPU a 2.5M-parameter draft forward
costs ~2 ms through transformers, which is what decides whether a tree level pays.  This module
runs the same math as ``GPTNeoXForCausalLM`` in a plain function (gpt-fast style): one fused
QKV matmul, partial rotary from a precomputed table, SDPA, parallel or sequential residual.

It is a runner (runtime.py): the engine calls ``forward([Seq, ...])`` and gets one
``runtime.Output`` per sequence; ``LeanNeoX(model)(input_ids=, attention_mask=, position_ids=,
past_key_values=BufferCache, logits_to_keep=)`` is the same forward in transformers' terms (the
budget's profile, tests).  It shares the model's parameters (no copy).  Tests check logits against transformers in float64 for
prefill, cached steps and tree masks.  Llama-family models take packed.py; other
architectures, transformers' forward (models.HFRunner).

Two paths run that math.  On a float32 CPU model whose shapes the C kernels take, every cached
forward is one call into csrc/neox.c (cmodel.py; batch invariant, so tree logits are bitwise AR
logits; a long prompt's prefill a few calls, ``cmodel.NATIVE_ROWS`` rows at a time).  Everything
else — other dtypes and devices, no C compiler, ``--kernel lean-mkl`` — runs the torch ops below.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cmodel, native
from .config import MKL_PACK_BYTES
from .names import NEOX_ACTS
from .runtime import Output, Seq, attend_each, heads_each, kept_rows, rotate_half, row_spans, seq_masks


PACK_HINT = 64  # oneDNN packs for this many rows; measured flat-ish from 2 to 16 rows on this CPU


def can_pack(model) -> bool:
    """oneDNN-packed weights for multi-row forwards: CPU, float32, and weights big enough to be
    memory-bound (a 10 MB draft stays in cache and gets slower packed) yet small enough to keep a
    second copy (the 1-row path keeps the plain weights, which are faster there)."""
    n_bytes = native.param_bytes(model)
    return (model.device.type == "cpu" and model.dtype == torch.float32 and MKL_PACK_BYTES[0] <= n_bytes <= MKL_PACK_BYTES[1]
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
    return rope.get("rope_type", "default") == "default" and cfg.hidden_act in NEOX_ACTS


class LeanNeoX(cmodel.Runner):
    def __init__(self, model, gemm: bool = True, isa: str | None = None, pack: bool = True, release: bool = False,
                 compute: str = "float32"):
        """gemm: run cached forwards through csrc/neox.c (native.py) where it applies, else torch;
        isa: the kernel variant (default: native.variant(), i.e. $DYNATREE_ISA or native); pack:
        let torch's path keep a oneDNN copy of the weights (can_pack); release: free each float32
        matrix once the C forward has packed it (cmodel.Runner.packed_callback; torch's path then
        cannot run); compute: "bfloat16" for the C forward's bfloat16 matrix products (lean-bf16)."""
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
        # why the C forward does not run this model ("" when it does: cmodel.refusal)
        self.refusal = cmodel.refusal(model, self._shape(), gemm, isa, compute)
        self.native = not self.refusal
        # The torch path serves everything when not native, and when native the rare forward it
        # does not take (a long causal one keeping many rows' logits, a cache of another dtype).
        pack = pack and can_pack(model) and not self.native
        self.lm_head = Linear(model.lm_head.weight, None, pack)  # d -> V
        self.layers = [(
            (l.input_layernorm.weight, l.input_layernorm.bias),
            (l.post_attention_layernorm.weight, l.post_attention_layernorm.bias),
            *(Linear(m.weight, m.bias, pack) for m in (l.attention.query_key_value, l.attention.dense,
                                                       l.mlp.dense_h_to_4h, l.mlp.dense_4h_to_h)),
        ) for l in core.layers]
        if self.native:
            self._init_native(core, native.library(isa), release, compute)

    def _init_native(self, core, lib, release: bool = False, compute: str = "float32") -> None:
        """csrc/neox.c's forward over this model's weights, its fused QKV rows permuted from
        NeoX's per-head [q k v] interleaving to the kernel's [q heads | k heads | v heads]."""
        H, hd = self.heads, self.head_dim
        order = torch.arange(3 * H * hd).view(H, 3, hd).transpose(0, 1).reshape(-1)  # new row -> NeoX row

        def qkv(m):  # the weight as row blocks (views), packed without a permuted copy of it
            blocks = [m.weight[(h * 3 + s) * hd:(h * 3 + s + 1) * hd] for s in range(3) for h in range(H)]
            return blocks, (m.bias[order] if m.bias is not None else None)

        layers = [cmodel.Layer((l.input_layernorm.weight, l.input_layernorm.bias),
                               (l.post_attention_layernorm.weight, l.post_attention_layernorm.bias),
                               qkv(l.attention.query_key_value), (l.attention.dense.weight, l.attention.dense.bias),
                               (l.mlp.dense_h_to_4h.weight, l.mlp.dense_h_to_4h.bias),
                               (l.mlp.dense_4h_to_h.weight, l.mlp.dense_4h_to_h.bias)) for l in core.layers]
        self.lib = lib
        self.fwd = cmodel.NativeForward(lib, self._shape(), self.embed, self.cos, self.sin, self.final_ln,
                                        self.model.lm_head.weight, layers, self.packed_callback(release), compute)
        self.weight_format = self.fwd.weight_format

    def _shape(self) -> cmodel.Shape:
        cfg = self.config
        act = cfg.hidden_act if cfg.hidden_act in ("gelu", "relu") else f"{cfg.hidden_act} (NeoX)"
        return cmodel.Shape(cfg.hidden_size, self.heads, self.heads, self.head_dim, self.rot, cfg.intermediate_size,
                            act, False, self.parallel, self.eps, self.scaling)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (1, H, n, hd); cos/sin: (1, 1, n, r) -> x with its first r dims rotated."""
        r = self.rot
        xr, xp = x[..., :r], x[..., r:]
        return torch.cat((xr * cos + rotate_half(xr) * sin, xp), dim=-1)

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

def lean(model, gemm: bool = True):
    """The lean forward for a supported model, else the model itself."""
    return LeanNeoX(model, gemm) if model is not None and supports(model) else model
