"""GPT-NeoX checkpoints loaded without transformers' modeling code.

Why: an actor's start-up was mostly imports.  ``AutoModelForCausalLM.from_pretrained`` imports
transformers' GPT-NeoX modeling module, which pulls in ``torch.distributed.tensor`` and
``torch._dynamo``: 1.5-2 s per process on this project's 2-core hosts, against ~0.05 s to read a
27M-parameter safetensors file.  The engine never runs transformers' forward on the lean kernels
(lean.py reads the weights and runs its own), so for them a module tree holding the same
parameters under the same attribute paths is enough.  transformers' own classes are still used
for ``--kernel hf``, transformers' peers in ``bench``, hub names and anything this loader does
not recognise (other architectures, rope scaling, activations other than gelu/relu, ``.bin``
checkpoints).
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

ACTS = {"gelu": nn.GELU, "relu": nn.ReLU}  # transformers' ACT2FN["gelu"] is F.gelu (exact erf), as nn.GELU()


def readable(path: str) -> bool:
    """A local GPT-NeoX checkpoint this loader can read (else: transformers' from_pretrained)."""
    p = Path(path)
    try:
        cfg = json.loads((p / "config.json").read_text())
    except (OSError, ValueError):
        return False
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return (cfg.get("model_type") == "gpt_neox" and cfg.get("hidden_act") in ACTS
            and rope.get("rope_type", rope.get("type", "default")) == "default"
            and any(p.glob("*.safetensors")))


class _Rotary(nn.Module):
    """inv_freq exactly as transformers' compute_default_rope_parameters (a float32 buffer)."""

    def __init__(self, cfg):
        super().__init__()
        rope = cfg.rope_parameters
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = 1.0


class _Layer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, bias = cfg.hidden_size, cfg.attention_bias
        self.input_layernorm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.attention = nn.Module()
        self.attention.query_key_value = nn.Linear(d, 3 * d, bias=bias)
        self.attention.dense = nn.Linear(d, d, bias=bias)
        self.attention.scaling = (d // cfg.num_attention_heads) ** -0.5
        self.mlp = nn.Module()
        self.mlp.dense_h_to_4h = nn.Linear(d, cfg.intermediate_size)
        self.mlp.dense_4h_to_h = nn.Linear(cfg.intermediate_size, d)
        self.mlp.act = ACTS[cfg.hidden_act]()


class NeoXWeights(nn.Module):
    """GPTNeoXForCausalLM's parameters under its attribute paths, without its forward."""

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.gpt_neox = nn.Module()
        self.gpt_neox.embed_in = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.gpt_neox.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.gpt_neox.final_layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.gpt_neox.rotary_emb = _Rotary(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, *args, **kwargs):
        raise TypeError("this model was loaded for dynatree's lean kernels (dynatree.checkpoint); "
                        "load the pair with kernel='hf' to run transformers' forward")


@contextmanager
def _no_init():
    """Skip the modules' random initialisation (seconds for a billion parameters), as
    transformers' own loading does: the init functions the modules call become no-ops."""
    names = ("kaiming_uniform_", "uniform_", "normal_", "ones_", "zeros_")
    saved = {n: getattr(nn.init, n) for n in names}
    try:
        for n in names:
            setattr(nn.init, n, lambda tensor, *a, **k: tensor)
        yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)


SKIP = (".inv_freq", ".masked_bias", ".attention.bias")  # buffers older transformers saved; recomputed


def load(path: str, dtype: torch.dtype, device: torch.device) -> NeoXWeights:
    """The checkpoint in ``path`` (readable() must hold) as float ``dtype`` weights on ``device``.
    Raises ValueError on a tensor name or shape the checkpoint should not have."""
    from safetensors import safe_open
    from transformers import GPTNeoXConfig  # configuration only: no modeling import

    cfg = GPTNeoXConfig.from_pretrained(path)
    with _no_init():  # every parameter is replaced below (the meta device would import torch._dynamo)
        model = NeoXWeights(cfg)
    state = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:  # one tensor at a time: peak memory ~ the model
            for k in st.keys():
                if not k.endswith(SKIP):
                    # embed_out: the checkpoint's name for transformers' lm_head
                    state["lm_head.weight" if k == "embed_out.weight" else k] = st.get_tensor(k).to(dtype)
    if cfg.tie_word_embeddings:  # one parameter, as transformers ties it
        state.pop("lm_head.weight", None)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:  # a tensor of the wrong shape
        raise ValueError(f"not a GPT-NeoX checkpoint dynatree can read: {e}") from None
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.gpt_neox.embed_in.weight
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"not a GPT-NeoX checkpoint dynatree can read: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    return model.to(device).eval().requires_grad_(False)
