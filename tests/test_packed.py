"""packed.py: Llama-family models decode many sequences per forward -- and each sequence gets
what transformers' own forward gives it alone (float64)."""
import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from dynatree import decode, make_config, pair_from_models
from dynatree.engine import decode_batch
from dynatree.models import HFRunner
from dynatree.packed import PackedRunner, supports

from conftest import alone_and_packed, assert_same_runs, random_prompts

FAMILIES = {  # GQA in all; Qwen2 with biases on q/k/v; Qwen3 with per-head q/k norms and head_dim != d / heads
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}


def tiny(family: str, seed: int, vocab: int = 64):
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    extra = {"head_dim": 16} if family == "qwen3" else {}
    cfg = config_cls(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                     tie_word_embeddings=False, eos_token_id=0, bos_token_id=0, **extra)
    model = model_cls(cfg).double().eval()
    with torch.no_grad():  # norms start at 1: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_sequences_get_transformers_logits(family):
    """A tree, a chain, one token and a prompt joining with an empty cache, packed in one forward:
    each sequence's logits and cache are what transformers' forward gives it alone."""
    model = tiny(family, 3)
    assert supports(model)
    assert_same_runs(*alone_and_packed(model, PackedRunner(model), ref=HFRunner(model)), atol=1e-10)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_llama_pair_decodes_batched_and_equals_ar(family):
    """The engine takes the packed runner for a Llama (or Qwen3) pair, and batched greedy rows of
    every kind equal batch-1 ar (float64)."""
    target = tiny(family, 5)
    draft = tiny(family, 6)
    with torch.no_grad():  # a related draft, so trees get accepted nodes
        for pt, pd in zip(target.parameters(), draft.parameters()):
            pd.copy_(pt + 0.3 * (pd - pt))
    pair = pair_from_models(target, draft, None, eos_token_id=None)
    assert isinstance(pair.runner("target"), PackedRunner)
    prompts = random_prompts(5, seed=7, lo=2, hi=20, vocab=64)
    refs = [decode(pair, p, make_config("ar"), max_new_tokens=12, ignore_eos=True)[0] for p in prompts]
    for method in ("ar", "linear", "dynatree"):
        got = decode_batch(pair, prompts, make_config(method), max_new_tokens=12, ignore_eos=True)
        assert [toks for toks, _, _ in got] == refs, method
    window = {"kv_window": 24, "kv_sinks": 2, "kv_evict": 6}  # StreamingLLM: evicting, keys turned back
    refs = [decode(pair, p, make_config("ar", window), max_new_tokens=20, ignore_eos=True)[0] for p in prompts]
    got = decode_batch(pair, prompts, make_config("dynatree", window), max_new_tokens=20, ignore_eos=True)
    assert [toks for toks, _, _ in got] == refs


def test_other_architectures_keep_transformers_forward():
    model = tiny("llama", 1)
    model.config.model_type = "phi3"  # not in the family: transformers' forward, one sequence at a time
    assert not supports(model)
    pair = pair_from_models(model, None, None, eos_token_id=None)
    assert isinstance(pair.runner("target"), HFRunner)
    sliding = tiny("qwen3", 1)  # a layer of sliding-window attention: not reproduced here
    sliding.config.layer_types = ["full_attention", "sliding_attention"]
    assert supports(tiny("qwen3", 1)) and not supports(sliding)
