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
from pathlib import Path

import torch
from torch import nn

from .names import SKIP, safetensors_files as files

ACTS = {"gelu": nn.GELU, "relu": nn.ReLU}  # transformers' ACT2FN["gelu"] is F.gelu (exact erf), as nn.GELU()



def readable(path: str) -> bool:
    """A local GPT-NeoX checkpoint this loader can read (else: transformers' from_pretrained):
    safetensors, gelu or relu, default rotary, head_dim = hidden_size / heads (what lean.py runs)."""
    p = Path(path)
    try:
        cfg = json.loads((p / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if cfg.get("model_type") != "gpt_neox" or cfg.get("hidden_act") not in ACTS or not files(path):
        return False
    for key in ("rope_scaling", "rope_parameters"):  # the config class lets rope_scaling win
        rope = cfg.get(key) or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            return False
    head_dim = cfg.get("head_dim")
    return head_dim is None or head_dim * cfg.get("num_attention_heads", 0) == cfg.get("hidden_size")


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


class _NoInit:
    def reset_parameters(self) -> None:
        """Left uninitialised: load() replaces every parameter (random init costs seconds per
        billion parameters; transformers' loading skips it too)."""


class _Linear(_NoInit, nn.Linear):
    pass


class _LayerNorm(_NoInit, nn.LayerNorm):
    pass


class _Embedding(_NoInit, nn.Embedding):
    pass


class _Layer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, bias = cfg.hidden_size, cfg.attention_bias
        self.input_layernorm = _LayerNorm(d, eps=cfg.layer_norm_eps)
        self.post_attention_layernorm = _LayerNorm(d, eps=cfg.layer_norm_eps)
        self.attention = nn.Module()
        self.attention.query_key_value = _Linear(d, 3 * d, bias=bias)
        self.attention.dense = _Linear(d, d, bias=bias)
        self.attention.scaling = (d // cfg.num_attention_heads) ** -0.5
        self.mlp = nn.Module()
        self.mlp.dense_h_to_4h = _Linear(d, cfg.intermediate_size)
        self.mlp.dense_4h_to_h = _Linear(cfg.intermediate_size, d)
        self.mlp.act = ACTS[cfg.hidden_act]()


class NeoXWeights(nn.Module):
    """GPTNeoXForCausalLM's parameters under its attribute paths, without its forward."""

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.gpt_neox = nn.Module()
        self.gpt_neox.embed_in = _Embedding(cfg.vocab_size, cfg.hidden_size)
        self.gpt_neox.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.gpt_neox.final_layer_norm = _LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.gpt_neox.rotary_emb = _Rotary(cfg)
        self.lm_head = _Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, *args, **kwargs):
        raise TypeError("this model was loaded for dynatree's lean kernels (dynatree.checkpoint); load the "
                        "pair with kernel='hf' or transformers_models=True to run transformers' forward")




def load(path: str, dtype: torch.dtype, device: torch.device) -> NeoXWeights:
    """The checkpoint in ``path`` (readable() must hold) as float ``dtype`` weights on ``device``.
    Raises ValueError on a tensor name or shape the checkpoint should not have."""
    from safetensors import safe_open
    from transformers import GPTNeoXConfig  # configuration only: no modeling import

    cfg = GPTNeoXConfig.from_pretrained(path)
    model = NeoXWeights(cfg)  # (not on the meta device: that would import torch._dynamo)
    state = {}
    for f in files(path):
        with safe_open(str(f), framework="pt") as st:  # one tensor at a time: peak memory ~ the model
            for k in st.keys():
                name = "lm_head.weight" if k == "embed_out.weight" else k  # the checkpoint's name for it
                if name in state:
                    raise ValueError(f"tensor {k!r} is stored twice ({f.name})")
                if not k.endswith(SKIP):
                    state[name] = st.get_tensor(k).to(dtype)
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
    model.generation_config = _generation_config(path, cfg)
    return model.to(device).eval().requires_grad_(False)


def _generation_config(path: str, cfg):
    """generation_config.json where there is one (its eos_token_id list ends generations, as in
    transformers' generate), else the one transformers derives from the model config."""
    from transformers import GenerationConfig

    if (Path(path) / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(path)
    return GenerationConfig.from_model_config(cfg)
