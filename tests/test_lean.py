"""The lean GPT-NeoX forward computes what transformers computes (float64)."""
import pytest
import torch

from dynatree.kvcache import new_cache
from dynatree.lean import LeanNeoX, supports
from dynatree.tree import Tree, ancestor_matrix, flatten_bfs, position_ids, tree_attention_mask

from conftest import alone_and_packed, assert_same_runs, hf_cache, tiny_neox


@pytest.mark.parametrize("parallel", [True, False])
def test_lean_matches_transformers(parallel):
    hf = tiny_neox(3, layers=3)
    hf.config.use_parallel_residual = parallel
    for layer in hf.gpt_neox.layers:
        layer.use_parallel_residual = parallel
    lean = LeanNeoX(hf)
    assert supports(hf)
    prompt = torch.tensor([[5, 9, 11, 40, 2, 7, 7]])
    with torch.inference_mode():
        ref = hf(input_ids=prompt).logits
        c_hf, c_lean = new_cache(hf, 64), new_cache(hf, 64)
        a = hf(input_ids=prompt, **hf_cache(hf, c_hf), use_cache=True).logits
        b = lean(input_ids=prompt, past_key_values=c_lean).logits
        assert torch.allclose(a, ref, atol=1e-12) and torch.allclose(b, ref, atol=1e-12)
        last = lean(input_ids=prompt, logits_to_keep=1).logits  # no cache, causal
        assert torch.allclose(last[0, -1], ref[0, -1], atol=1e-12) and last.shape[1] == 1
        # a tree after the cached prompt: mask + position ids, and a cached single step
        tree, _ = flatten_bfs(Tree([3, 4, 5, 6, 8], [-1, 0, 0, 1, 1], [0, 1, 1, 2, 2], [0.0] * 5))
        anc = ancestor_matrix(tree.parents)
        mask = tree_attention_mask(anc, prompt.shape[1], torch.float64)
        pos = position_ids(tree.depths, prompt.shape[1])
        ids = torch.tensor([tree.tokens])
        a = hf(input_ids=ids, attention_mask=mask, position_ids=pos, **hf_cache(hf, c_hf), use_cache=True).logits
        b = lean(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=c_lean).logits
        assert torch.allclose(a, b, atol=1e-12)
        for c in (c_hf, c_lean):
            c.truncate(prompt.shape[1])
        step = torch.tensor([[17]])
        a = hf(input_ids=step, **hf_cache(hf, c_hf), use_cache=True).logits
        b = lean(input_ids=step, past_key_values=c_lean).logits
        assert torch.allclose(a, b, atol=1e-12)
        full = hf(input_ids=torch.cat([prompt, step], 1)).logits[:, -1]
        assert torch.allclose(b[:, -1], full, atol=1e-12)


def test_unsupported_models_fall_back():
    from transformers import GPT2Config, GPT2LMHeadModel

    from dynatree.lean import lean
    m = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    assert lean(m) is m


@pytest.mark.parametrize("parallel", [True, False])
def test_packed_torch_forward_gives_each_sequence_its_own_logits(parallel):
    """The torch path (GPUs, other dtypes, lean-mkl) packs several sequences into one forward --
    a tree, a chain, one token, a prompt joining with an empty cache, different prefix lengths --
    and each gets what it gets alone (float64: the packed GEMMs round no differently that shows),
    heads and cache entries included."""
    model = tiny_neox(13, layers=2)
    model.config.use_parallel_residual = parallel
    lean = LeanNeoX(model, gemm=False)
    alone, alone_caches, packed, packed_caches = alone_and_packed(model, lean)
    assert_same_runs(alone, alone_caches, packed, packed_caches, atol=1e-12)
    assert packed[3].logits.shape[1] == 1  # keep=1: the joining prompt's last row only
