"""A GPT-NeoX model grown to another model's cost without changing what it computes
(``dynatree widen``): the paper's sizes on hardware where only a small trained pair exists.

The bench pair (27M / 2.5M parameters) shows the engine where a forward is cheap; a corpus job on
Pythia-2.8B/70M streams 100x the weights per token.  Random weights at that size would measure the
forwards but not acceptance (a random draft never agrees with a random target).  A *widened* copy
does both: it has the large model's matrices, so every forward costs what the large model's does,
and it computes the small model's function, so the draft agrees with it as often as with the
small target.  Greedy exactness is then checked against the widened target's own `ar`, as always.

How a hidden state of width d becomes one of width r*d with the same values: it is held as r
copies, h' = [h, ..., h].  A layer norm of h' has h's mean and variance, so its output is r copies
of h's.  Every matrix that *reads* the hidden state reads copy 0 (zeros against the others), and
every matrix that *writes* it writes all r copies.  Heads follow: head c*H + j is a copy of head j
(the attention output projection reads copies c = 0 only).  Layers beyond the model's own are
identities at full cost: a copy of a real layer whose two output projections are zero, which the
parallel residual (x + attn + mlp) adds as exact zeros.  Extra vocabulary rows score ``FLOOR``
below nothing the model says: the final norm writes a constant 1 into one dimension of copy 1
(its scale 0, its shift 1), which only the extra rows of the LM head read.

Values agree with the small model up to the rounding of norms over r times as many terms, so a
greedy token may differ where two logits nearly tie; speed is what the widened pair is for.
"""
from __future__ import annotations

import copy

import torch

FLOOR = -50.0  # the extra vocabulary's logit: exp(-50) ~ 2e-22 per token, nothing against real mass


def _reads(w: torch.Tensor, r: int) -> torch.Tensor:
    """(out, in) -> (out, r*in): read copy 0 of the input, zeros against copies 1..r-1."""
    return torch.cat([w] + [torch.zeros_like(w)] * (r - 1), dim=1)


def _writes(t: torch.Tensor, r: int) -> torch.Tensor:
    """(out, ...) -> (r*out, ...): write every copy of the output."""
    return torch.cat([t] * r, dim=0)


def _qkv(w: torch.Tensor, heads: int, r: int) -> torch.Tensor:
    """GPT-NeoX's fused qkv rows are per head [q | k | v] (its view(heads, 3*head_dim)): the
    widened model's heads c*H + j are copies of head j, reading hidden copy 0."""
    per_head = w.reshape(heads, -1, *w.shape[1:])  # (H, 3*hd, in), or (H, 3*hd) for the bias
    stacked = torch.cat([per_head] * r, dim=0).reshape(-1, *w.shape[1:])  # (r*H*3*hd, ...)
    return _reads(stacked, r) if w.dim() == 2 else stacked


def _widen_layer(layer, heads: int, r: int, identity: bool):
    """One GPT-NeoX layer's parameters, widened (its output projections zero if ``identity``)."""
    attn, mlp = layer.attention, layer.mlp
    out = {
        "input_layernorm.weight": _writes(layer.input_layernorm.weight, r),
        "input_layernorm.bias": _writes(layer.input_layernorm.bias, r),
        "post_attention_layernorm.weight": _writes(layer.post_attention_layernorm.weight, r),
        "post_attention_layernorm.bias": _writes(layer.post_attention_layernorm.bias, r),
        "attention.query_key_value.weight": _qkv(attn.query_key_value.weight, heads, r),
        "attention.dense.weight": _writes(_reads(attn.dense.weight, r), r),
        "mlp.dense_h_to_4h.weight": _writes(_reads(mlp.dense_h_to_4h.weight, r), r),
        "mlp.dense_4h_to_h.weight": _writes(_reads(mlp.dense_4h_to_h.weight, r), r),
    }
    if attn.query_key_value.bias is not None:
        out["attention.query_key_value.bias"] = _qkv(attn.query_key_value.bias, heads, r)
        out["attention.dense.bias"] = _writes(attn.dense.bias, r)
    out["mlp.dense_h_to_4h.bias"] = _writes(mlp.dense_h_to_4h.bias, r)
    out["mlp.dense_4h_to_h.bias"] = _writes(mlp.dense_4h_to_h.bias, r)
    if identity:  # the residual adds exact zeros: the layer costs what a real one does and changes nothing
        for name in ("attention.dense.weight", "attention.dense.bias", "mlp.dense_4h_to_h.weight", "mlp.dense_4h_to_h.bias"):
            if name in out:
                out[name] = torch.zeros_like(out[name])
    return out


def _sizes(cfg, factor: int, layers: int | None, vocab: int | None) -> tuple[int, int]:
    """(layers, vocab) of the widened model (None: the model's own); ValueError for a model or
    sizes widen cannot grow (checked from the config alone, before the weights load)."""
    if cfg.model_type != "gpt_neox" or not cfg.use_parallel_residual:
        raise ValueError(f"widen takes GPT-NeoX models with the parallel residual, not {cfg.model_type}")
    n, v = cfg.num_hidden_layers, cfg.vocab_size
    layers, vocab = layers or n, vocab or v
    short = [f"{what} {got} < {least}" for what, got, least in (("factor", factor, 1), ("layers", layers, n),
                                                               ("vocab", vocab, v)) if got < least]
    if short:  # (each named with what it must reach: the model's own size, or 1 copy)
        raise ValueError(f"widen grows a model, never shrinks it: {', '.join(short)}")
    if vocab > v and factor < 2:
        raise ValueError("extra vocabulary needs factor >= 2 (copy 1 of the hidden state carries its constant)")
    return layers, vocab


def widened(model, factor: int, layers: int | None = None, vocab: int | None = None):
    """(config, state dict) of a GPT-NeoX causal LM ``factor`` times as wide (hidden, heads, MLP),
    with ``layers`` layers (identities past the model's own) and ``vocab`` LM-head rows (extra ones
    at FLOOR), computing ``model``'s function (see the module docstring), in ``model``'s dtype.
    No model is built: at Pythia-2.8B's size that would initialise 2.8B random weights first."""
    cfg, r = model.config, factor
    n, v = cfg.num_hidden_layers, cfg.vocab_size
    layers, vocab = _sizes(cfg, factor, layers, vocab)
    new_cfg = copy.deepcopy(cfg)
    new_cfg.hidden_size, new_cfg.num_attention_heads = r * cfg.hidden_size, r * cfg.num_attention_heads
    new_cfg.intermediate_size, new_cfg.num_hidden_layers, new_cfg.vocab_size = r * cfg.intermediate_size, layers, vocab
    state, base = {}, model.gpt_neox
    for i in range(layers):
        for name, t in _widen_layer(base.layers[i % n], cfg.num_attention_heads, r, identity=i >= n).items():
            state[f"gpt_neox.layers.{i}.{name}"] = t
    embed = _writes(base.embed_in.weight.T, r).T  # (V, r*d): every copy
    state["gpt_neox.embed_in.weight"] = torch.cat([embed, embed.new_zeros(vocab - v, embed.shape[1])])
    norm_w, norm_b = _writes(base.final_layer_norm.weight, r), _writes(base.final_layer_norm.bias, r)
    head = _reads(model.get_output_embeddings().weight, r)  # (V, r*d)
    extra = head.new_zeros(vocab - v, head.shape[1])
    if vocab > v:  # dimension 0 of copy 1: constant 1 after the final norm, read by the extra rows alone
        d = cfg.hidden_size
        norm_w, norm_b = norm_w.clone(), norm_b.clone()
        norm_w[d], norm_b[d] = 0.0, 1.0
        extra[:, d] = FLOOR
    state["gpt_neox.final_layer_norm.weight"], state["gpt_neox.final_layer_norm.bias"] = norm_w, norm_b
    state["lm_head.weight"] = torch.cat([head, extra])  # (transformers 5 names embed_out so)
    return new_cfg, {k: t.detach().contiguous() for k, t in state.items()}


def _check_dirs(src: str, out: str) -> None:
    """Refuse an OUT that would overwrite SRC or anything already there (before any loading)."""
    from pathlib import Path

    from .names import model_problem

    s, o = Path(src).resolve(), Path(out).resolve()
    if not s.is_dir():  # (transformers' own words otherwise: "Unrecognized model ... model_type", "Error no file named")
        raise ValueError(f"SRC {src} is not a saved model: not a directory")
    if model_problem(str(s)):
        raise ValueError(f"SRC {src} is not a saved model: {model_problem(str(s))}")
    if o == s or s in o.parents:
        raise ValueError(f"OUT {out} is SRC or inside it: widen writes a new model beside SRC")
    if o.exists() and (not o.is_dir() or any(o.iterdir())):
        raise ValueError(f"OUT {out} exists and is not an empty directory: give a new one")


def widen_dir(src: str, out: str, factor: int, layers: int | None = None, vocab: int | None = None) -> str:
    """Widen the GPT-NeoX model saved in directory ``src`` into ``out`` (config, safetensors in the
    stored dtype, and ``src``'s tokenizer and generation files); returns a one-line summary."""
    import shutil
    from pathlib import Path

    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    if (layers is not None and layers < 1) or (vocab is not None and vocab < 1):  # (0 would read as "SRC's")
        raise ValueError(f"--layers and --vocab must be positive (got {layers}, {vocab})")
    _check_dirs(src, out)
    _sizes(AutoConfig.from_pretrained(src), factor, layers, vocab)  # (before seconds of loading weights)
    model = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
    cfg, state = widened(model, factor, layers, vocab)
    del model
    Path(out).mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(out)
    weights = Path(out) / "model.safetensors"
    save_file(state, str(weights), metadata={"format": "pt"})
    shutil.copymode(Path(out) / "config.json", weights)  # (safetensors writes a private temp file)
    for f in Path(src).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "generation_config")):
            shutil.copyfile(f, Path(out) / f.name)
    params = sum(t.numel() for t in state.values())
    return (f"{out}: {params / 1e6:.1f}M parameters (hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, "
            f"{cfg.num_attention_heads} heads, vocab {cfg.vocab_size}), {cfg.dtype}")
