"""Tiny GPT-NeoX models built from a config (no downloads), shared by the tests."""
from __future__ import annotations

import random

import pytest
from dynatree.tokenizer import train_bpe_tokenizer
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from dynatree import pair_from_models
from dynatree.models import cache_kw


def hf_cache(model, cache) -> dict:
    """A transformers forward's cache argument under the name this version takes (past_key_values
    warns in 5.x and goes in 5.40)."""
    return {cache_kw(model): cache}

VOCAB = 96
EOS = 3


@pytest.fixture(autouse=True)
def _no_shared_cores_note(monkeypatch):
    """The commands' note on CPUs other processes use (cli._threads) reads the machine's load: off
    in tests, whose output must not depend on what else runs (tests/test_demo_pair.py tests it)."""
    from dynatree import machine

    monkeypatch.setattr(machine, "busy_cpus", lambda seconds=0.25: None)


@pytest.fixture(autouse=True)
def _collectable_heap():
    """Tests that run an actor or a command in this process freeze its heap (metrics.freeze_heap,
    for processes that keep one pair): undone after each, so later tests' garbage stays collectable."""
    yield
    import gc

    gc.unfreeze()


def tiny_neox(seed: int, *, vocab: int = VOCAB, layers: int = 2, hidden: int = 32, max_pos: int = 128,
              std: float = 0.3, dtype=torch.float64) -> GPTNeoXForCausalLM:
    torch.manual_seed(seed)
    cfg = GPTNeoXConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=4, intermediate_size=2 * hidden,
                        max_position_embeddings=max_pos, rotary_pct=0.5, initializer_range=std,
                        use_parallel_residual=True, tie_word_embeddings=False,
                        eos_token_id=EOS, bos_token_id=EOS)
    return GPTNeoXForCausalLM(cfg).to(dtype).eval()


def noisy_copy(model, seed: int, scale: float):
    """A draft that agrees with the target often but not always."""
    draft = tiny_neox(0, vocab=model.config.vocab_size, layers=model.config.num_hidden_layers,
                      hidden=model.config.hidden_size, max_pos=model.config.max_position_embeddings,
                      dtype=model.dtype)
    draft.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
    return draft


@pytest.fixture(scope="session")
def target():
    return tiny_neox(1)


@pytest.fixture(scope="session")
def close_pair(target):
    """Draft = target + small noise: long accepted paths, frequent misses."""
    return pair_from_models(target, noisy_copy(target, 7, 0.04), None, eos_token_id=EOS)


@pytest.fixture(scope="session")
def far_pair(target):
    """An unrelated draft: most drafted tokens rejected."""
    return pair_from_models(target, tiny_neox(2, layers=1, hidden=16), None, eos_token_id=EOS)


@pytest.fixture(scope="session")
def same_pair(target):
    """Draft identical to the target: every drafted path that the policy keeps is accepted."""
    return pair_from_models(target, noisy_copy(target, 0, 0.0), None, eos_token_id=EOS)


def random_prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 24, vocab: int = VOCAB) -> list[list[int]]:
    rng = random.Random(seed)
    # avoid EOS in prompts so that a stop is always a generated EOS
    return [[rng.choice([t for t in range(vocab) if t != EOS]) for _ in range(rng.randint(lo, hi))]
            for _ in range(n)]


TEXT = ["The quick brown fox jumps over the lazy dog. " * 3,
        "It was the best of times, it was the worst of times.",
        "Call me Ishmael. Some years ago, never mind how long precisely."] * 10


@pytest.fixture(scope="session")
def pair_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    tok = train_bpe_tokenizer(TEXT, 300)
    n = len(tok)
    for name, seed, layers in (("target", 1, 2), ("draft", 2, 1)):
        m = tiny_neox(seed, vocab=n, layers=layers, dtype=torch.float32)
        m.config.eos_token_id = m.config.bos_token_id = tok.eos_token_id
        m.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    other = train_bpe_tokenizer(TEXT[:2] + ["completely different words here"], 280)
    m = tiny_neox(3, vocab=len(other), layers=1, dtype=torch.float32)
    m.save_pretrained(root / "foreign")
    other.save_pretrained(root / "foreign")
    return root


def mixed_batch(model, runner):
    """What a packed forward must get right, as ``steps(caches)``: four sequences after prompts of
    different lengths -- a tree (KeyMask, depth positions), a chain, one token, a prompt joining
    with an empty cache (keep=1).  Returns (prefilled: () -> fresh caches holding the prompts
    run through ``runner``, steps)."""
    from dynatree.kvcache import new_cache
    from dynatree.runtime import KeyMask, Seq
    from dynatree.tree import Tree, ancestor_matrix, flatten_bfs, position_ids

    tree, _ = flatten_bfs(Tree([17, 23, 50, 4, 60], [-1, 0, 0, 1, 1], [0, 1, 1, 2, 2], [0.0] * 5))
    prompts = [[5, 9, 11, 40, 2, 7], [3, 4], [8] * 12, []]

    def steps(caches):
        p0 = caches[0].length
        return [Seq(torch.tensor(tree.tokens), caches[0], position_ids(tree.depths, p0)[0],
                    KeyMask(p0, ancestor_matrix(tree.parents))),
                Seq(torch.tensor([30, 31, 32]), caches[1]),
                Seq(torch.tensor([44]), caches[2]),
                Seq(torch.tensor([6, 7, 8, 9]), caches[3], keep=1)]

    def prefilled():
        caches = [new_cache(model, 64) for _ in prompts]
        for c, p in zip(caches, prompts):
            if p:
                runner(input_ids=torch.tensor([p]), past_key_values=c)
        return caches

    return prefilled, steps


def alone_and_packed(model, runner, ref=None):
    """The mixed batch run two ways: each sequence alone through ``ref`` (default: ``runner``),
    and all four in one packed forward through ``runner``, each from freshly prefilled caches.
    Returns (alone outputs, their caches, packed outputs, their caches)."""
    ref = ref or runner
    prefilled_ref, steps = mixed_batch(model, ref)
    prefilled = prefilled_ref if ref is runner else mixed_batch(model, runner)[0]
    with torch.inference_mode():
        ref_caches = prefilled_ref()
        alone = [ref.forward([s], topk=3)[0] for s in steps(ref_caches)]
        caches = prefilled()
        packed = runner.forward(steps(caches), topk=3)
    return alone, ref_caches, packed, caches


def assert_same_runs(alone, alone_caches, packed, packed_caches, atol: float) -> None:
    """Each sequence's logits (within atol), top-k ids and cache keys are what it got alone."""
    for a, b in zip(alone, packed):
        assert a.logits.shape == b.logits.shape and torch.allclose(a.logits, b.logits, rtol=0, atol=atol)
        assert list(a.top[1]) == list(b.top[1])
    for ca, cb in zip(alone_caches, packed_caches):
        assert ca.length == cb.length
        for la, lb in zip(ca.layers, cb.layers):
            assert torch.allclose(la.keys[:, :, :ca.length], lb.keys[:, :, :cb.length], rtol=0, atol=atol)
