"""Prefix caching (prefix.py): prompts that begin alike compute their beginning once, and no output
changes -- bitwise on the native kernel, in float64 on torch's."""
from __future__ import annotations

import random
import shutil

import pytest
import torch

from conftest import EOS, noisy_copy, random_prompts, tiny_neox
from dynatree import native, pair_from_models
from dynatree.config import make_config
from dynatree.engine import BatchDecoder, decode, decode_batch
from dynatree.kvcache import BufferCache
from dynatree.runtime import Seq
from dynatree.prefix import BLOCK, PrefixStore, chain_hashes, prefill_shared, remember

HEADS, DIM = 2, 4


def filled(tokens: list[int], layers: int = 2) -> BufferCache:
    """A cache whose slot j holds keys (token_j + 1000 * layer) and values minus that."""
    cache = BufferCache(layers, 128)
    for i, layer in enumerate(cache.layers):
        layer.reserve(len(tokens), HEADS, DIM, torch.float32, torch.device("cpu"))
        for j, t in enumerate(tokens):
            layer.keys[0, :, j] = t + 1000 * i
            layer.values[0, :, j] = -(t + 1000 * i)
        layer.length = len(tokens)
    return cache


def block_bytes(layers: int = 2) -> int:
    return layers * 2 * HEADS * BLOCK * DIM * 4


def test_a_chain_is_stored_once_two_prompts_began_with_it_and_then_copied():
    store = PrefixStore(1 << 20)
    a = list(range(100))  # three whole blocks and four tokens
    remember(store, [(filled(a), a)])
    assert store.bytes == 0  # seen once: a prompt that never repeats costs only its hashes
    b = a[:70] + [500] * 30  # shares two blocks with a (its third differs)
    remember(store, [(filled(b), b)])
    assert store.bytes == 2 * block_bytes()
    c = a[:64] + [7]  # 65 tokens: both blocks, its last token left to compute
    cache = BufferCache(2, 128)
    held, copied = prefill_shared(store, None, [(cache, c)])
    assert held == copied == [64] and cache.length == 64
    assert torch.equal(cache.layers[1].keys[0, :, :64], filled(a).layers[1].keys[0, :, :64])
    assert torch.equal(cache.layers[0].values[0, :, :64], filled(a).layers[0].values[0, :, :64])
    # a prompt of exactly two blocks reuses one: its last token must run through the model
    assert prefill_shared(store, None, [(BufferCache(2, 128), a[:64])])[0] == [32]
    assert prefill_shared(store, None, [(BufferCache(2, 128), [9] + a[1:64] + [1])])[0] == [0]
    assert store.reused == 96


def test_chain_hashes_cover_every_block_before():
    t = list(range(96))
    assert chain_hashes(t, 2) == chain_hashes(t[:64] + [0], 2)
    assert chain_hashes(t, 3)[1] != chain_hashes([1] + t[1:], 3)[1]  # a change in block 0 reaches block 1


def test_the_least_recently_used_chain_leaves_first_with_its_descendants():
    store = PrefixStore(3 * block_bytes())
    a, b = list(range(70)), list(range(64)) + [99] * 6  # one chain of two blocks
    remember(store, [(filled(a), a), (filled(b), b)])
    assert store.bytes == 2 * block_bytes()
    c = [50] * 70
    remember(store, [(filled(c), c), (filled(c), c)])  # a second chain of two blocks: over the cap
    assert store.bytes == 2 * block_bytes()  # the old chain went whole (its second block is useless alone)
    assert prefill_shared(store, None, [(BufferCache(2, 128), a)])[0] == [0]
    assert prefill_shared(store, None, [(BufferCache(2, 128), c)])[0] == [64]


def test_a_lazily_shared_chain_evicted_before_it_is_stored_again_is_stored_from_its_keys():
    """The native kernel's copy leaves the shared slots of a row's own cache unwritten; when the
    chain is evicted before the row stores it again, the store must take the segment's keys, not
    those slots (it stored uninitialised memory, which every later prompt copied)."""
    store = PrefixStore(2 * block_bytes())  # room for one chain of two blocks
    a = list(range(70))
    remember(store, [(filled(a), a), (filled(a), a)])
    row = BufferCache(2, 128)
    assert prefill_shared(store, None, [(row, a)], lazy=True)[0] == [64]
    for layer in row.layers:  # what new_empty may hold in the slots the kernel reads from the segment
        layer.keys[0, :, :64] = float("nan")
        layer.values[0, :, :64] = float("nan")
    c = [50] * 70
    remember(store, [(filled(c), c), (filled(c), c)])  # evicts a's chain
    assert prefill_shared(store, None, [(BufferCache(2, 128), a)])[0] == [0]
    remember(store, [(row, a)])  # a seen again: stored from the row
    again = BufferCache(2, 128)
    assert prefill_shared(store, None, [(again, a)])[0] == [64]
    assert torch.equal(again.layers[1].keys[0, :, :64], filled(a).layers[1].keys[0, :, :64])
    assert torch.equal(again.layers[0].values[0, :, :64], filled(a).layers[0].values[0, :, :64])


def test_off_means_no_store():
    assert prefill_shared(None, None, [(BufferCache(2, 8), [1, 2])]) == ([0], [0])
    pair = pair_from_models(tiny_neox(1), None, None, eos_token_id=EOS)
    pair.prefix_cache_bytes = 0
    assert pair.prefix_store("target") is None


HEADER = random.Random(5).choices([t for t in range(96) if t != EOS], k=75)  # two whole blocks and 11


def templated(n: int, seed: int) -> list[list[int]]:
    """Prompts rendered from one template: the header, then a few tokens of their own."""
    rng = random.Random(seed)
    return [HEADER + rng.choices([t for t in range(96) if t != EOS], k=rng.randint(1, 12)) for _ in range(n)]


def decode_joining(pair, prompts, cfg, n=12):
    """Half the prompts start together; the rest join one by one as the batch runs."""
    dec, got = BatchDecoder(pair), {}
    half = len(prompts) // 2
    for i, p in enumerate(prompts[:half]):
        dec.add(p, cfg, max_new_tokens=n, ignore_eos=True, key=i)
    late = list(range(half, len(prompts)))
    while dec or late:
        if late:
            i = late.pop(0)
            dec.add(prompts[i], cfg, max_new_tokens=n, ignore_eos=True, key=i)
        got.update((k, (t, m)) for k, t, _, m in dec.step())
    return [got[i] for i in range(len(prompts))]


@pytest.mark.parametrize("method,opts,kernel", [("ar", {}, "lean"), ("dynatree", {}, "lean"), ("linear", {"k": 3}, "lean"),
                                                ("dynatree", {"temperature": 0.9, "seed": 4}, "lean"),
                                                ("ar", {"kv_dtype": "bfloat16"}, "lean"), ("dynatree", {}, "hf")])
def test_templated_prompts_decode_as_without_prefix_caching_float64(method, opts, kernel):
    """torch paths (dynatree's packed forward, transformers' own), float64: the same tokens with
    and without sharing, starting together or joining late; every prompt after the first two
    copies the header's two whole blocks (target and draft)."""
    target = tiny_neox(1)
    pair = pair_from_models(target, noisy_copy(target, 7, 0.04), None, eos_token_id=EOS, kernel=kernel)
    assert not getattr(pair.runner("target"), "native", False)
    prompts, cfg = templated(6, seed=1), make_config(method, opts)
    pair.prefix_cache_bytes = 0
    plain = decode_joining(pair, prompts, cfg)
    pair.prefix_cache_bytes = 1 << 30
    shared = decode_joining(pair, prompts, cfg)
    assert [t for t, _ in shared] == [t for t, _ in plain]
    assert all(m.cached_prompt_tokens == 0 for _, m in plain)
    cached = [m.cached_prompt_tokens for _, m in shared]
    assert cached.count(2 * BLOCK) >= 4 and set(cached) <= {0, 2 * BLOCK}, cached
    if method != "ar":
        assert pair.prefix_store("draft", cfg.kv_dtype).reused >= 4 * 2 * BLOCK


def test_a_prompt_said_to_come_again_is_kept_from_its_first_prefill():
    """A job's samples of one prompt join as batch slots free up, one by one: told that the prompt
    comes again, the store keeps it after the first prefill, so every later sample copies it."""
    target = tiny_neox(1)
    pair = pair_from_models(target, noisy_copy(target, 7, 0.04), None, eos_token_id=EOS)
    prompt, cfg = templated(1, seed=3)[0], make_config("dynatree", {"temperature": 0.9})

    def one_by_one(again):
        pair.forget_prefixes()
        out = []
        for k in range(3):
            dec = BatchDecoder(pair)
            dec.add(prompt, cfg, max_new_tokens=4, again=again and k < 2)
            while dec:
                out += [m.cached_prompt_tokens for _, _, _, m in dec.step()]
        return out

    assert one_by_one(False) == [0, 0, 2 * BLOCK]
    assert one_by_one(True) == [0, 2 * BLOCK, 2 * BLOCK]


@pytest.mark.parametrize("opts", [{"kv_window": 48, "kv_sinks": 4, "kv_evict": 8}, {"prefix_cache": False}])
def test_rows_with_a_cache_window_or_the_option_off_do_not_share(opts):
    target = tiny_neox(1)
    pair = pair_from_models(target, noisy_copy(target, 7, 0.04), None, eos_token_id=EOS)
    cfg = make_config("dynatree", opts)
    outs = decode_batch(pair, templated(4, seed=2) * 2, cfg, max_new_tokens=10, ignore_eos=True)
    assert all(m.cached_prompt_tokens == 0 for _, _, m in outs)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
@pytest.mark.parametrize("method", ["ar", "dynatree"])
def test_copied_prefixes_are_the_bits_a_prefill_writes_native(method):
    """Native kernel, float32, no tolerance: after the prefill every row's target and draft caches
    hold bitwise what they hold without sharing, and the tokens are batch-1 ar's."""
    t, d = tiny_neox(31, hidden=64, dtype=torch.float32), tiny_neox(32, hidden=64, layers=1, dtype=torch.float32)
    pair = pair_from_models(t, d, None, eos_token_id=EOS)
    assert pair.runner("target").native
    prompts, cfg = templated(5, seed=3), make_config(method)
    caches = {}
    for cap in (0, 1 << 30):
        pair.prefix_cache_bytes = cap
        pair.forget_prefixes()
        dec = BatchDecoder(pair)
        for i, p in enumerate(prompts):
            dec.add(p, cfg, max_new_tokens=8, ignore_eos=True, key=i)
        dec._prefill(dec.joining)
        dec._draft_prefill([r for r in dec.joining if r.drafter])  # (the drafts' part, at a row's first tree)
        for r in dec.joining:  # the kernel reads shared slots from the store's copy; a torch forward would copy them in
            for c in (r.cache, *([r.drafter.cache] if r.drafter else [])):
                assert c.shared is None or c.shared.own == (c.shared.length == 0 or r is dec.joining[0])
                c.own_slots()
        caches[cap] = [[(l.keys[0, :, :len(r.prompt)].clone(), l.values[0, :, :len(r.prompt)].clone())
                        for c in (r.cache, *([r.drafter.cache] if r.drafter else [])) for l in c.layers]
                       for r in dec.joining]
        assert sum(r.cached_tokens for r in dec.joining) == (4 * 2 * BLOCK if cap else 0)
    for plain, shared in zip(caches[0], caches[1 << 30]):
        assert all(torch.equal(a, b) for kv0, kv1 in zip(plain, shared) for a, b in zip(kv0, kv1))
    refs = [decode(pair, p, make_config("ar"), max_new_tokens=16, ignore_eos=True)[0] for p in prompts]
    assert [o[0] for o in decode_batch(pair, prompts, cfg, max_new_tokens=16, ignore_eos=True)] == refs


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
@pytest.mark.parametrize("isa", native.variants_here())
@pytest.mark.parametrize("family,stepped", [("neox", False), ("qwen3", False), ("neox", True)])
def test_the_kernel_reads_a_shared_prefix_from_its_one_copy(isa, family, stepped, monkeypatch):
    """On every variant, for GPT-NeoX and a grouped-query Llama-family model: rows that share a
    prefix point at the store's copy (kvcache.BufferCache.shared) and the C forward reads it from
    there -- with each row's own copy of those slots wiped, the tokens are still batch-1 ar's,
    bitwise; with the store's copy wiped, they are not.  ``stepped``: the prompts extend a stored
    one-block template by a block, so their chain lies in two segments, read as two pieces."""
    monkeypatch.setenv("DYNATREE_ISA", isa)
    if family == "neox":
        t, d = tiny_neox(31, hidden=64, dtype=torch.float32), tiny_neox(32, hidden=64, layers=1, dtype=torch.float32)
    else:
        from test_packed import llama32

        t, d = llama32(family, 5), llama32(family, 6)
    pair = pair_from_models(t, d, None, eos_token_id=EOS)
    assert pair.runner("target").native and pair.runner("draft").native
    prompts, cfg = templated(4, seed=6), make_config("dynatree")
    rng, vocab = random.Random(9), [t for t in range(96) if t != EOS]
    if stepped:  # another second block, the same in every prompt
        ext = rng.choices(vocab, k=BLOCK)
        prompts = [p[:BLOCK] + ext + p[2 * BLOCK:] for p in prompts]
    refs = [decode(pair, p, make_config("ar"), max_new_tokens=16, ignore_eos=True)[0] for p in prompts]

    def run(wipe):
        pair.forget_prefixes()
        if stepped:  # the first block stored first (target and draft), as a segment of its own (one
            # prompt at a time: a batch's first iterations are plain, drafts fed at a row's first tree)
            for _ in range(2):
                decode_batch(pair, [HEADER[:BLOCK] + rng.choices(vocab, k=9)], cfg, max_new_tokens=2)
        dec = BatchDecoder(pair)
        for i, p in enumerate(prompts):
            dec.add(p, cfg, max_new_tokens=16, ignore_eos=True, key=i)
        dec._prefill(dec.joining)
        dec._draft_prefill(dec.joining)  # (what the rows' first tree does)
        dec.active, dec.joining = dec.joining, []  # what step() does after its prefill
        caches = [c for r in dec.active for c in (r.cache, r.drafter.cache)]
        assert all(c.shared is not None and c.shared.length == 2 * BLOCK for c in caches[2:])
        assert all(len(c.shared.pieces) == 1 + stepped for c in caches[2:])
        with torch.inference_mode():  # (stepped: the template's segment was made under it)
            for c in caches:
                wipe(c)
        got = {}
        while dec:
            got.update((k, toks) for k, toks, _, _ in dec.step())
        return [got[i] for i in range(len(prompts))]

    def own(c):  # a row's own copy of what it shares
        n = c.shared.length if c.shared is not None else 0
        for l in c.layers:
            l.keys[:, :, :n] = 0
            l.values[:, :, :n] = 0

    def store_copy(c):  # the last piece (the template's extension, when stepped)
        if c.shared is not None:
            for k in c.shared.pieces[-1][0].keys:
                k.zero_()

    assert run(lambda c: None) == refs
    assert run(own) == refs
    assert run(store_copy) != refs


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
def test_a_torch_forward_copies_a_shared_prefix_in_first(monkeypatch):
    """A cache the native kernel reads a prefix of from the store (its own slots never written)
    still gives a torch forward the right keys: they are copied in before it runs."""
    t = tiny_neox(31, hidden=64, dtype=torch.float32)
    pair = pair_from_models(t, None, None, eos_token_id=EOS)
    runner = pair.runner("target")
    prompts = templated(3, seed=8)
    dec = BatchDecoder(pair)
    for p in prompts:
        dec.add(p, make_config("ar"), max_new_tokens=4, ignore_eos=True)
    dec._prefill(dec.joining)
    lazy = dec.joining[2].cache
    assert lazy.shared is not None and not lazy.shared.own
    pair.prefix_cache_bytes = 0
    plain = BatchDecoder(pair)
    plain.add(prompts[2], make_config("ar"), max_new_tokens=4, ignore_eos=True)
    plain._prefill(plain.joining)
    monkeypatch.setattr(runner, "native", False)
    outs = [runner.forward([Seq(torch.tensor([5]), c)])[0].logits for c in (lazy, plain.joining[0].cache)]
    assert lazy.shared.own and torch.equal(outs[0], outs[1])


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
def test_a_group_extending_a_stored_chain_computes_the_rest_once():
    """A stored first block, then two prompts joining together that share two: one computes the
    second block (the other reads it from the store), both read the first from the store (the one
    that copied both: in two pieces); every cache, made whole, is bitwise what a plain prefill
    writes, and the tokens are ar's."""
    t = tiny_neox(31, hidden=64, dtype=torch.float32)
    pair = pair_from_models(t, None, None, eos_token_id=EOS)
    rng = random.Random(9)
    tail = lambda: rng.choices([x for x in range(96) if x != EOS], k=5)  # noqa: E731
    short = [HEADER[:BLOCK] + tail() for _ in range(2)]  # share block 0 only
    decode_batch(pair, short, make_config("ar"), max_new_tokens=2, ignore_eos=True)
    pair2 = [HEADER + tail() for _ in range(2)]  # share blocks 0 and 1
    dec = BatchDecoder(pair)
    for p in pair2:
        dec.add(p, make_config("ar"), max_new_tokens=8, ignore_eos=True)
    dec._prefill(dec.joining)
    assert sorted(r.cached_tokens for r in dec.joining) == [BLOCK, 2 * BLOCK]
    assert sorted(len(r.cache.shared.pieces) for r in dec.joining) == [1, 2]
    assert all(r.cache.shared.length == r.cached_tokens and not r.cache.shared.own for r in dec.joining)
    pair.prefix_cache_bytes = 0
    for r in dec.joining:
        plain = BatchDecoder(pair)
        plain.add(r.prompt, make_config("ar"), max_new_tokens=8, ignore_eos=True)
        plain._prefill(plain.joining)
        r.cache.own_slots()
        n = len(r.prompt)
        assert all(torch.equal(a.keys[0, :, :n], b.keys[0, :, :n]) and torch.equal(a.values[0, :, :n], b.values[0, :, :n])
                   for a, b in zip(r.cache.layers, plain.joining[0].cache.layers))
    pair.prefix_cache_bytes = 1 << 30
    refs = [decode(pair, p, make_config("ar"), max_new_tokens=8, ignore_eos=True)[0] for p in pair2]
    assert [toks for toks, _, _ in decode_batch(pair, pair2, make_config("ar"), max_new_tokens=8, ignore_eos=True)] == refs


def test_a_draft_reading_only_the_prompts_end_shares_nothing_and_stores_nothing():
    """draft_context shorter than the prompts: the draft's cache holds the prompt's last tokens at
    positions from 0, which are not the prompt's prefix -- storing them would hand other rows wrong
    keys.  The target still shares; the draft store stays empty; the tokens are unchanged."""
    target = tiny_neox(1)
    pair = pair_from_models(target, noisy_copy(target, 7, 0.04), None, eos_token_id=EOS)
    prompts = templated(6, seed=1)
    plain = decode_joining(pair, prompts, make_config("dynatree", {"draft_context": 0}))
    pair.forget_prefixes()
    bounded = decode_joining(pair, prompts, make_config("dynatree", {"draft_context": 16}))
    assert [t for t, _ in bounded] == [t for t, _ in plain]
    assert [m.cached_prompt_tokens for _, m in bounded].count(2 * BLOCK) >= 4
    draft = pair.prefix_store("draft", "model")
    assert draft.reused == 0 and draft.bytes == 0


def test_identical_whole_block_prompts_in_one_batch_decode_like_alone(close_pair):
    """Two rows with the same 64-token prompt (two whole prefix blocks) join together: the shared
    chain must leave the last prompt token to compute (its logits give the first new token)."""
    prompt = random_prompts(1, seed=3, lo=64, hi=64)[0]
    cfg = make_config("ar")
    alone = decode(close_pair, prompt, cfg, max_new_tokens=5, ignore_eos=True)[0]
    got = decode_batch(close_pair, [prompt, prompt], cfg, max_new_tokens=5, ignore_eos=True)
    assert [t for t, _, _ in got] == [alone, alone]


def test_a_chain_just_reused_outlives_one_stored_later_but_unused():
    """Least recently *used*: a prompt copying a chain makes it the newest, so the next eviction
    takes the chain nobody has read since it was stored."""
    store = PrefixStore(2 * block_bytes())  # room for two one-block chains
    a, b, c = list(range(40)), list(range(100, 140)), list(range(200, 240))
    for p in (a, b):
        remember(store, [(filled(p), p), (filled(p), p)])
    assert prefill_shared(store, None, [(BufferCache(2, 128), a)])[0] == [BLOCK]  # a read after b was stored
    remember(store, [(filled(c), c), (filled(c), c)])  # a third: one must go
    assert [prefill_shared(store, None, [(BufferCache(2, 128), p)])[0] for p in (a, b, c)] == [[BLOCK], [0], [BLOCK]]


def test_a_prompt_of_whole_blocks_stores_all_of_them_for_longer_prompts():
    """A prompt that is exactly two blocks (a bare template) keeps its last token to compute when
    it is copied, but a longer prompt that extends it copies both blocks."""
    store = PrefixStore(1 << 20)
    a = list(range(2 * BLOCK))
    remember(store, [(filled(a), a), (filled(a), a)])
    assert store.bytes == 2 * block_bytes()
    assert prefill_shared(store, None, [(BufferCache(2, 128), a + [7] * 6)])[0] == [2 * BLOCK]


def test_dropping_a_template_frees_the_extension_stored_after_it():
    """A chain stored in steps (a template block, then a prompt's block after it) lies in two
    segments; when the template leaves, the extension is unreachable and its memory goes too."""
    store = PrefixStore(3 * block_bytes())
    a = list(range(40))
    b = a[:BLOCK] + list(range(300, 300 + BLOCK)) + [5] * 6
    remember(store, [(filled(a), a), (filled(a), a)])
    remember(store, [(filled(b), b), (filled(b), b)])
    assert store.bytes == 2 * block_bytes()
    c = [50] * 70
    remember(store, [(filled(c), c), (filled(c), c)])  # two blocks more: over the cap, the template goes
    assert store.bytes == 2 * block_bytes()  # c's two blocks: the template's and the extension's memory went
    assert prefill_shared(store, None, [(BufferCache(2, 128), b)])[0] == [0]


def test_evicted_and_forgotten_blocks_free_their_memory_without_a_garbage_collection():
    """A dropped subtree was a reference cycle (parent <-> children) holding its segments' tensors
    until a cyclic collection: a service's RSS grew by every eviction past the cap (the service trial)."""
    import gc
    import weakref

    store = PrefixStore(2 * block_bytes())
    a, c = list(range(70)), [50] * 70
    gc.disable()
    try:
        remember(store, [(filled(a), a), (filled(a), a)])
        held = [weakref.ref(t) for n in store.lru for t in n.segment.keys + n.segment.values]
        remember(store, [(filled(c), c), (filled(c), c)])  # a's chain evicted
        assert held and all(r() is None for r in held)
        held = [weakref.ref(t) for n in store.lru for t in n.segment.keys]
        store.clear()
        assert store.bytes == 0 and not store.lru and all(r() is None for r in held)
    finally:
        gc.enable()


def test_the_counting_table_forgets_the_chain_least_recently_begun(monkeypatch):
    """The table of chains seen once is bounded (SEEN): a full table drops the chain begun longest
    ago -- a chain begun again counts as recent, and the newest chain is always counted."""
    import dynatree.prefix as prefix

    monkeypatch.setattr(prefix, "SEEN", 2)
    store = PrefixStore(1 << 20)
    x, y, z = ([t] * 40 for t in (1, 2, 3))
    for p in (x, y, x, z):  # x begun again after y: y is now the oldest, and z's arrival drops it
        remember(store, [(filled(p), p)])
    assert store.bytes == block_bytes()  # x, seen twice
    remember(store, [(filled(z), z)])  # z, newest when the table was full, was counted: now twice
    assert store.bytes == 2 * block_bytes()
    remember(store, [(filled(y), y)])  # y was forgotten: once again, not stored
    assert store.bytes == 2 * block_bytes()
    assert prefill_shared(store, None, [(BufferCache(2, 128), y)])[0] == [0]
