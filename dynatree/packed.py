"""A packed multi-sequence forward for Llama-family models (Llama, Mistral, Qwen2, Qwen3), over
the model's own modules.

Why: transformers' forward takes one batch tensor and one cache, while each of the engine's
sequences has its own cache (kvcache.BufferCache), so through transformers a batch costs one
forward per sequence -- one stream over the weights per row, which is what batching exists to
avoid (on a GPU, the whole cost of a decode step).  Here every projection and MLP runs over all
sequences' rows at once and attention runs per sequence over its own cache (SDPA, grouped-query
heads), with the model's own norms, projections, rotary embedding and MLP, so the math is the
model's.  Tested against transformers' forward in float64 (tests/test_packed.py).  GPT-NeoX
models take lean.py instead; other architectures keep transformers' forward (models.HFRunner).

On a float32 CPU model whose shapes the C kernels take (a head size the attention kernel has, a
SiLU MLP, a rotary table that does not depend on the sequence's length), cached forwards run csrc/neox.c's
whole forward instead (cmodel.py), as GPT-NeoX models do: batch invariant, so tree logits are
bitwise AR logits and greedy outputs equal ``ar``'s without a tolerance.
"""
from __future__ import annotations

import torch

from . import cmodel, native
from .config import NATIVE_FAMILIES
from .names import FIXED_ROPE, rope_switch  # (rotaries the C forward reads from one table)
from .runtime import (Output, Seq, attend_each, base_forward_source, heads_each, kept_rows, model_window, rotate_half,
                      row_spans, seq_masks)

FAMILY = tuple(f for f in NATIVE_FAMILIES if f != "gpt_neox")  # the Llama family
_ATTN = {"q_proj", "k_proj", "v_proj", "o_proj"}
_HEAD_NORMS = {"qwen3": {"q_norm", "k_norm"}}  # RMS norms over each head's q and k, before rotary
_MLP = {"gate_proj", "up_proj", "down_proj", "act_fn"}


def supports(model) -> bool:
    """A decoder this forward reproduces exactly: the family's layer layout and nothing more (no
    q/k norms but Qwen3's per-head ones, no sliding window that could bind)."""
    cfg = getattr(model, "config", None)
    core = getattr(model, "model", None)
    if getattr(cfg, "model_type", None) not in FAMILY or core is None or not hasattr(core, "rotary_emb"):
        return False
    if model_window(model) is not None:
        return False
    if "sliding_window" in base_forward_source(model) and any(
            kind != "full_attention" for kind in getattr(cfg, "layer_types", None) or ()):
        return False  # (a layer kind the architecture reads)
    layer = core.layers[0]
    return ({n for n, _ in layer.self_attn.named_children()} == _ATTN | _HEAD_NORMS.get(cfg.model_type, set())
            and {n for n, _ in layer.mlp.named_children()} <= _MLP
            and {"input_layernorm", "post_attention_layernorm"} <= {n for n, _ in layer.named_children()})


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (1, H, N, hd); cos/sin: (1, 1, N, hd) -> rotate-half rotary, as the family applies it."""
    return x * cos + rotate_half(x) * sin


class PackedRunner(cmodel.Runner):
    """The engine's runner (runtime.py) for a supported model: ``forward(seqs)`` packs them."""

    def __init__(self, model, gemm: bool = True, isa: str | None = None, pack: bool = False, release: bool = False,
                 compute: str = "float32"):
        """gemm: run cached forwards through the C kernels where they apply (cmodel.py), else
        torch; isa: the kernel variant (default: native.variant()); pack: unused (this torch path
        keeps no oneDNN copy; the argument is lean.LeanNeoX's); release, compute: as lean.LeanNeoX's."""
        self.model, self.config, self.dtype, self.device = model, model.config, model.dtype, model.device
        attn = model.model.layers[0].self_attn
        self.heads, self.kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.switch = rope_switch(self.config)
        rope = (getattr(self.config, "rope_parameters", None) or {}).get("rope_type", "default")
        # why the C forward does not run this model ("" when it does: cmodel.refusal)
        self.refusal = cmodel.refusal(model, self._shape(), gemm, isa, compute) or (
            f"its rotary type {rope!r} rescales with the length" if rope not in FIXED_ROPE else "")
        self.native = not self.refusal
        if self.native:
            self.lib = native.library(isa)
            self.fwd = _native_forward(model, self.lib, self._shape(), self.packed_callback(release), compute)
            self.weight_format = self.fwd.weight_format

    def _shape(self) -> cmodel.Shape:
        cfg = self.config
        act = "swiglu" if cfg.hidden_act == "silu" else f"{cfg.hidden_act} (gated)"
        return cmodel.Shape(cfg.hidden_size, self.heads, self.kv_heads, self.head_dim, self.head_dim,
                            cfg.intermediate_size, act, True, False, cfg.rms_norm_eps, self.scaling)

    def _torch(self, seqs: list[Seq], topk: int, argmax: bool, cols: int | None) -> list[Output]:
        core = self.model.model
        spans = row_spans(seqs)
        masks = seq_masks(seqs, self.dtype, self.device)
        h = core.embed_tokens(torch.cat([s.ids.reshape(-1) for s in seqs]).to(self.device))[None]  # (1, N, d)
        cos, sin = self._rotary(h, [p for p, _ in masks])  # (1, N, hd)
        cos, sin = cos[:, None], sin[:, None]
        for i, layer in enumerate(core.layers):
            h = h + self._attend(i, layer.self_attn, layer.input_layernorm(h), cos, sin, seqs, spans, masks)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h, keeps = kept_rows(h, seqs, spans)  # (1, K, d): only the logits asked for
        logits = self.model.lm_head(core.norm(h))  # (1, K, V)
        return heads_each(logits, keeps, topk, argmax, cols, [s.perturb for s in seqs])

    def _rotary(self, h: torch.Tensor, positions: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (1, N, hd) of the packed rows (positions: (1, n) per sequence), each sequence's
        as the model computes them for it alone.  LongRoPE reads the table of a call's largest
        position (names.rope_switch), so sequences on either side of its switch get a call each
        (the engine keeps every sequence's forward on one side)."""
        rotary = self.model.model.rotary_emb
        if self.switch is None:
            return rotary(h, torch.cat(positions, dim=1))
        late = (torch.stack([p.max() for p in positions]) >= self.switch).tolist()  # kept host sync: each's table
        parts: list = [None] * len(positions)
        for side in set(late):
            idx = [i for i, x in enumerate(late) if x == side]
            cos, sin = rotary(h, torch.cat([positions[i] for i in idx], dim=1))
            sizes = [positions[i].shape[1] for i in idx]
            for i, c, s in zip(idx, cos.split(sizes, dim=1), sin.split(sizes, dim=1)):
                parts[i] = (c, s)
        return torch.cat([c for c, _ in parts], dim=1), torch.cat([s for _, s in parts], dim=1)

    def _attend(self, i: int, attn, x, cos, sin, seqs, spans, masks) -> torch.Tensor:
        """Layer i's attention block: projections over all rows, attention per sequence over its
        own cache.  x: (1, N, d) -> (1, N, d)."""
        N, hd = x.shape[1], self.head_dim
        q, k = attn.q_proj(x).view(1, N, self.heads, hd), attn.k_proj(x).view(1, N, self.kv_heads, hd)
        if hasattr(attn, "q_norm"):  # Qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = _rotate(q.transpose(1, 2), cos, sin)  # (1, Hq, N, hd)
        k = _rotate(k.transpose(1, 2), cos, sin)  # (1, Hkv, N, hd)
        v = attn.v_proj(x).view(1, N, self.kv_heads, hd).transpose(1, 2)
        a = attend_each(q, k, v, seqs, spans, masks, i, self.scaling, self.heads != self.kv_heads)  # (1, Hq, N, hd)
        return attn.o_proj(a.transpose(1, 2).reshape(1, N, self.heads * hd))


def _native_forward(model, lib, shape: cmodel.Shape, packed=None, compute: str = "float32") -> cmodel.NativeForward:
    """csrc/neox.c's forward over a Llama-family model: q/k/v fused into one matrix, gate and up
    into another; the rotary table precomputed by the model's own rotary embedding."""
    core = model.model

    def cat(*mods):  # -> (weight as row blocks, bias or None) of the fused matrix
        biases = [m.bias for m in mods if m.bias is not None]
        if biases and len(biases) != len(mods):
            raise ValueError("some of the fused projections have biases and some do not")
        return [m.weight for m in mods], torch.cat(biases) if biases else None

    layers = []
    for layer in core.layers:
        attn, mlp = layer.self_attn, layer.mlp
        layers.append(cmodel.Layer(
            (layer.input_layernorm.weight, None), (layer.post_attention_layernorm.weight, None),
            cat(attn.q_proj, attn.k_proj, attn.v_proj), (attn.o_proj.weight, attn.o_proj.bias),
            cat(mlp.gate_proj, mlp.up_proj), (mlp.down_proj.weight, mlp.down_proj.bias),
            attn.q_norm.weight if hasattr(attn, "q_norm") else None,
            attn.k_norm.weight if hasattr(attn, "k_norm") else None))
    n_pos = model.config.max_position_embeddings
    with torch.no_grad():
        pos = torch.arange(n_pos)[None]
        cos, sin = core.rotary_emb(core.embed_tokens.weight[:1][None], pos)  # (1, max_pos, hd)
    return cmodel.NativeForward(lib, shape, core.embed_tokens.weight, cos[0].float().contiguous(),
                                sin[0].float().contiguous(), (core.norm.weight, None), model.lm_head.weight, layers,
                                packed, compute)
