"""The C kernels (csrc/gemm.c, csrc/neox.c): right answers, batch invariance, and fallbacks.

Batch invariance is the property the greedy guarantee leans on with this kernel: a tree node's
logits must be *bitwise* those of an AR step over the same path, so the tests compare with
torch.equal, not a tolerance."""
import os
import re
import shlex
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from dynatree import kbuild, native, pair_from_models
from dynatree.config import make_config
from dynatree.engine import decode
from dynatree.kvcache import new_cache
from dynatree.lean import LeanNeoX
from dynatree.runtime import KeyMask, Seq
from dynatree.tree import Tree, ancestor_matrix, flatten_bfs, position_ids

from conftest import alone_and_packed, mixed_batch

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")


@pytest.fixture(autouse=True, params=native.variants_here())
def isa(request, monkeypatch):
    """Every test here runs on each kernel variant this CPU can run: native, avx2 (x86 with AVX2),
    generic (the portable 128-bit code ARM compiles).  Models pack their weights for the variant
    in force when they are built."""
    monkeypatch.setenv("DYNATREE_ISA", request.param)
    return request.param


def neox32(seed: int, *, parallel: bool = True, vocab: int = 100, hidden: int = 64, layers: int = 2):
    """float32, head_dim 16: the smallest shape the native path takes; vocab 100 exercises padding."""
    torch.manual_seed(seed)
    cfg = GPTNeoXConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                        intermediate_size=2 * hidden, max_position_embeddings=128, rotary_pct=0.5,
                        initializer_range=0.3, use_parallel_residual=parallel, tie_word_embeddings=False,
                        eos_token_id=3, bos_token_id=3)
    return GPTNeoXForCausalLM(cfg).float().eval()


def test_library_builds_here(isa):
    assert native.library() is not None, native.status()
    assert native.status().startswith(f"{isa} variant: ")


def test_every_variant_computes_the_same_bits():
    """Blocking and vector width never change a result (each output is one FMA chain; every
    horizontal sum adds a logical 16-float vector in one order), so a corpus decoded on an AVX2
    node and an AVX-512 node is the same corpus.  42 cached keys: the attention's multi-key score
    passes (and AVX-512's transposed sums) run, not only their remainders."""
    prompt, path = [5, 9, 11, 40, 2, 7, 7] * 6, [17, 23, 4]
    tree, _ = flatten_bfs(Tree([17, 23, 50, 4, 60], [-1, 0, 0, 1, 1], [0, 1, 1, 2, 2], [0.0] * 5))
    seen = {}
    for v in native.variants_here():
        model = neox32(9, layers=2)
        lean = LeanNeoX(model, isa=v)
        assert lean.native and lean.lib is native.library(v)
        with torch.inference_mode():
            cache, p, ar = prefill_and_ar(lean, model, prompt, path)
            logits = lean(input_ids=torch.tensor([tree.tokens]), attention_mask=KeyMask(p, ancestor_matrix(tree.parents)),
                          position_ids=position_ids(tree.depths, p), past_key_values=cache).logits[0]
        seen[v] = torch.stack(ar), logits
    assert len(seen) >= 2  # native and generic everywhere
    first = next(iter(seen.values()))
    for v, (ar, logits) in seen.items():
        assert torch.equal(ar, first[0]) and torch.equal(logits, first[1]), v


def test_every_variant_draws_the_same_sampling_noise():
    """So a sampled corpus is the same corpus on every node too (sampling.py)."""
    noise = {}
    for v in native.variants_here():
        out = torch.empty(8203)
        native.library(v).dt_gumbel(0x9E3779B9, 12345, 8203, out.data_ptr())
        noise[v] = out
    first = next(iter(noise.values()))
    assert all(torch.equal(n, first) for n in noise.values()) and torch.isfinite(first).all()


def test_variants_that_cannot_run_here_say_so(monkeypatch, tmp_path):
    monkeypatch.setenv("DYNATREE_CACHE", str(tmp_path))
    lib, why = native._build("avx9")
    assert lib is None and "unknown DYNATREE_ISA='avx9'" in why
    monkeypatch.setattr(kbuild, "cpu_flags", lambda: "flags: fpu sse sse2")  # an x86 CPU without AVX2
    if kbuild._X86:
        lib, why = native._build("avx2")
        assert lib is None and "cannot run on this CPU" in why


def test_a_model_the_kernel_cannot_serve_for_want_of_a_build_says_so_once(monkeypatch, capsys):
    from dynatree import cmodel

    monkeypatch.setenv("DYNATREE_ISA", "avx9")  # a typo: the model runs on torch's kernels
    monkeypatch.setattr(cmodel, "_warned", set())
    assert not LeanNeoX(neox32(3)).native and not LeanNeoX(neox32(3)).native
    err = capsys.readouterr().err
    assert err.count("native CPU kernel is unavailable (unknown DYNATREE_ISA='avx9'") == 1
    monkeypatch.setenv("DYNATREE_GEMM", "0")  # asked for: nothing to say
    assert not LeanNeoX(neox32(3)).native and capsys.readouterr().err == ""
    monkeypatch.setenv("DYNATREE_GEMM", "Off")  # (only "0" turned it off: trial AM)
    assert not LeanNeoX(neox32(3)).native and capsys.readouterr().err == ""


def test_environment_switches_read_the_usual_spellings(monkeypatch):
    from dynatree.machine import env_on

    for value, on in (("0", False), ("false", False), ("OFF", False), (" no ", False), ("", True), ("1", True),
                      ("True", True), ("yes", True)):
        monkeypatch.setenv("DYNATREE_X", value)
        assert env_on("DYNATREE_X") is on, value
    monkeypatch.delenv("DYNATREE_X")
    assert env_on("DYNATREE_X")
    monkeypatch.setenv("DYNATREE_X", "fasle")  # (a typo: said, and the default kept)
    with pytest.warns(UserWarning, match="DYNATREE_X='fasle' is not 0/1"):
        assert env_on("DYNATREE_X")


@pytest.mark.parametrize("bias", [True, False])
def test_gemm_is_right_and_batch_invariant(bias):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(72, 40, generator=g)  # N = 72: padded to the tile width
    b = torch.randn(72, generator=g) if bias else None
    lin = native.PackedLinear(w, b)
    x = torch.randn(30, 40, generator=g)
    ref = x.double() @ w.double().t() + (b.double() if bias else 0)
    # 7, 8, 13, 14, 20: AVX2 and generic builds run the last 1-2 rows over several tiles (gemm_tail)
    for m in (1, 2, 5, 7, 8, 12, 13, 14, 20, 24, 30):
        y = lin(x[:m])
        assert y.shape == (m, 72)
        torch.testing.assert_close(y.double(), ref[:m], rtol=1e-5, atol=1e-5)
        for i in range(m):  # a row alone == the same row inside m rows, bit for bit
            assert torch.equal(lin(x[i:i + 1])[0], y[i])


@pytest.mark.parametrize("parallel", [True, False])
def test_native_forward_matches_transformers(parallel):
    model = neox32(1, parallel=parallel)
    lean = LeanNeoX(model)
    assert lean.native
    ids = torch.tensor([[5, 9, 11, 40, 2, 7, 7, 99]])
    with torch.inference_mode():
        ref = model(input_ids=ids).logits
        out = lean(input_ids=ids, past_key_values=new_cache(model, 32)).logits
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def prefill_and_ar(lean, model, prompt, path, capacity=64):
    """Prefill ``prompt``, then AR steps over ``path``; returns (cache cut back to the prompt,
    prompt length, AR logits after each path token)."""
    cache = new_cache(model, capacity)
    lean(input_ids=torch.tensor([prompt]), past_key_values=cache)
    p = cache.length
    ar = [lean(input_ids=torch.tensor([[t]]), past_key_values=cache).logits[0, -1] for t in path]
    cache.truncate(p)
    return cache, p, ar


@pytest.mark.parametrize("parallel", [True, False])
def test_tree_and_chain_logits_are_bitwise_ar_logits(parallel):
    model = neox32(2, parallel=parallel)
    lean = LeanNeoX(model)
    prompt, path = [5, 9, 11, 40, 2, 7], [17, 23, 4]
    with torch.inference_mode():
        cache, p, ar = prefill_and_ar(lean, model, prompt, path)
        # chain: the same tokens in one causal forward from the same prefix
        chain = lean(input_ids=torch.tensor([path]), past_key_values=cache).logits[0]
        assert all(torch.equal(chain[i], ar[i]) for i in range(3))
        # tree: the path plus siblings, BFS order; path nodes are 0 -> 1 -> 3
        cache.truncate(p)
        tree, _ = flatten_bfs(Tree([17, 23, 50, 4, 60], [-1, 0, 0, 1, 1], [0, 1, 1, 2, 2], [0.0] * 5))
        mask = KeyMask(p, ancestor_matrix(tree.parents))
        logits = lean(input_ids=torch.tensor([tree.tokens]), attention_mask=mask,
                      position_ids=position_ids(tree.depths, p), past_key_values=cache).logits[0]
        assert [tree.tokens[u] for u in (0, 1, 3)] == path
        assert torch.equal(logits[0], ar[0]) and torch.equal(logits[1], ar[1]) and torch.equal(logits[3], ar[2])
        # the same tree as an additive mask (transformers' form) gives the same logits
        cache.truncate(p)
        logits2 = lean(input_ids=torch.tensor([tree.tokens]), attention_mask=mask.additive(torch.float32),
                       position_ids=position_ids(tree.depths, p), past_key_values=cache).logits[0]
        assert torch.equal(logits, logits2)


def test_bad_token_id_is_an_error_and_leaves_the_cache_alone():
    model = neox32(3)
    lean = LeanNeoX(model)
    cache = new_cache(model, 16)
    with torch.inference_mode():
        lean(input_ids=torch.tensor([[1, 2, 3]]), past_key_values=cache)
        with pytest.raises(IndexError, match="outside the embedding"):
            lean(input_ids=torch.tensor([[4, 100]]), past_key_values=cache)
    assert cache.length == 3


def test_argmax_and_topk_match_torch():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 1000, generator=g)
    x[2, 17] = x[2, 900] = x[2].max() + 1  # a tie: the first index wins, as in torch
    assert native.argmax_rows(x) == x.argmax(-1).tolist()
    assert native.argmax_rows(x)[2] == 17
    vals, ids = native.topk_probs(x[:, :999], 5)  # a row length that is not a multiple of 16
    ref_v, ref_i = torch.softmax(x[:, :999], -1).topk(5, -1)
    assert ids[0] == ref_i[0].tolist() and ids[5] == ref_i[5].tolist()
    torch.testing.assert_close(torch.tensor(vals), ref_v, rtol=1e-5, atol=1e-7)
    y = torch.full((3, 37), -torch.inf)
    y[1, 30], y[1, 36], y[2, 5:9] = 2.0, 2.0, 1.0  # ties in the tail, in a vector, a row of -inf
    assert native.argmax_rows(y) == [0, 30, 5]
    assert native.topk_probs(y[2:], 3)[1] == [[5, 6, 7]]  # ties keep the lower id
    for k in (-1, y.shape[-1] + 1):  # (C would leave ids past the vocabulary unwritten: garbage)
        with pytest.raises(ValueError, match="top-k of"):
            native.topk_probs(y, k)
    assert native.topk_probs(y, 0) == ([[], [], []], [[], [], []])  # (the C call crashed: battery R)


def test_sampling_heads_are_torchs():
    """Sampling's heads fused into the forward (the kernel perturbs each kept row's logits in
    place, product rounded before the add) choose and propose exactly what the torch path computes
    from the plain logits (sampling.Sampler.choose / propose), on the native and the torch forward."""
    from dynatree.runtime import Seq
    from dynatree.sampling import Sampler
    model = neox32(12, vocab=100)
    s = Sampler(0.7, 0, 1.0, 11)
    tree, _ = flatten_bfs(Tree([17, 23, 50, 4, 60], [-1, 0, 0, 1, 1], [0, 1, 1, 2, 2], [0.0] * 5))
    for gemm in (True, False):  # the C kernel, and lean.py's torch forward
        lean = LeanNeoX(model, gemm=gemm)
        for j in range(5):
            s.at(j)
            outs = []
            for perturb in (None, s.head(tree.depths)):
                cache = new_cache(model, 32)
                with torch.inference_mode():
                    lean.forward([Seq(torch.tensor([5, 9, 11, 40]), cache)])
                    seq = Seq(torch.tensor(tree.tokens), cache, position_ids(tree.depths, 4)[0],
                              KeyMask(4, ancestor_matrix(tree.parents)), perturb=perturb)
                    outs.append(lean.forward([seq], topk=3, cols=90)[0])
                    cache.truncate(4)
                    outs.append(lean.forward([seq], argmax=True)[0])
            plain = outs[1].logits[0]
            assert outs[3].choice == s.choose(plain, tree.depths)
            assert outs[2].top == s.propose(plain[:, :90], tree.depths, 3)


def test_decoders_equal_ar_on_the_native_kernel():
    """No tolerance, no near-tie excuses: with a batch-invariant kernel every decoder's tokens
    are AR's because every verified logit is AR's logit."""
    target = neox32(5, layers=3)
    draft = neox32(6, layers=1)
    pair = pair_from_models(target, draft, None, eos_token_id=3)
    assert pair.runner("target").native and pair.runner("draft").native
    prompts = [[5, 9, 11], [40, 2, 7, 7, 1, 8], [3 + i for i in range(20)]]
    for prompt in prompts:
        ar, _, _ = decode(pair, prompt, make_config("ar"), max_new_tokens=40, ignore_eos=True)
        for method, opts in [("linear", {}), ("fixed_tree", {}), ("dynatree", {}),
                             ("dynatree", {"hw_budget": "off"}), ("dyspec", {})]:
            out, _, _ = decode(pair, prompt, make_config(method, opts), max_new_tokens=40, ignore_eos=True)
            assert out == ar, (method, opts, prompt)


def test_build_fallbacks(monkeypatch, tmp_path):
    monkeypatch.setenv("DYNATREE_CACHE", str(tmp_path))
    monkeypatch.setenv("DYNATREE_GEMM", "0")
    lib, why = native._build()
    assert lib is None and "DYNATREE_GEMM" in why
    monkeypatch.setenv("DYNATREE_GEMM", "1")
    monkeypatch.setenv("CC", "no-such-compiler-here")
    lib, why = native._build()
    assert lib is None and "no C compiler" in why
    monkeypatch.setenv("CC", "false")  # runs, prints nothing, fails to compile
    lib, why = native._build()
    assert lib is None and "failed" in why
    assert not list(tmp_path.glob("*.so"))  # no half-written object left behind
    hung = tmp_path / "hung-cc"  # answers --version, then never finishes a compile
    hung.write_text('#!/bin/sh\n[ "$1" = --version ] && echo hung 1.0 && exit 0\nexec sleep 60\n')
    hung.chmod(0o755)
    monkeypatch.setenv("CC", str(hung))
    monkeypatch.setattr(kbuild, "COMPILE_TIMEOUT_S", 1)
    lib, why = native._build()
    assert lib is None and "no result after 1 s" in why
    # an object others may load: the umask's mode, not mkstemp's private one (a cache built as root)
    fake = tmp_path / "fake-cc"  # writes a file where -o says
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] && echo fake 1.0 && exit 0\n'
                    'while [ $# -gt 0 ]; do [ "$1" = -o ] && echo x > "$2"; shift; done\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setattr(kbuild, "COMPILE_TIMEOUT_S", 60)
    lib, why = kbuild.build()
    umask = os.umask(0)
    os.umask(umask)
    assert lib is not None and lib.stat().st_mode & 0o777 == 0o755 & ~umask, why


def test_lean_falls_back_to_torch_without_the_library(monkeypatch):
    model = neox32(7)
    monkeypatch.setattr(native, "library", lambda isa=None: None)
    lean = LeanNeoX(model)
    assert not lean.native
    ids = torch.tensor([[5, 9, 11]])
    with torch.inference_mode():
        torch.testing.assert_close(lean(input_ids=ids, past_key_values=new_cache(model, 8)).logits,
                                   model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_cache_keep_moves_the_path_like_torch():
    from dynatree.kvcache import BufferCache

    caches = []
    for _ in range(2):
        c = BufferCache(3, 20)
        g = torch.Generator().manual_seed(8)
        for layer in c.layers:
            kv = torch.randn(1, 2, 12, 16, generator=g)
            layer.update(kv, kv * 2)
        caches.append(c)
    caches[0].keep(5, [5, 7, 10])  # native
    src = torch.tensor([5, 7, 10])
    for layer in caches[1].layers:  # torch, layer by layer
        layer.keep(5, src)
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert a.length == b.length == 8
        assert torch.equal(a.keys[:, :, :8], b.keys[:, :, :8]) and torch.equal(a.values[:, :, :8], b.values[:, :, :8])


def test_native_after_the_cache_grows_under_a_torch_prefill(monkeypatch):
    """A long prefill (torch path) may move the cache buffers; the native path must follow."""
    import dynatree.cmodel
    monkeypatch.setattr(dynatree.cmodel, "NATIVE_ROWS", 64)
    model = neox32(9)
    lean = LeanNeoX(model)
    prompt = [(7 * i) % 97 for i in range(80)]  # > NATIVE_ROWS tokens: the torch path
    with torch.inference_mode():
        small = new_cache(model, 4)
        lean(input_ids=torch.tensor([[1, 2]]), past_key_values=small)  # native, capacity 4
        small.truncate(0)
        lean(input_ids=torch.tensor([prompt]), past_key_values=small)  # torch path: buffers grow
        a = lean(input_ids=torch.tensor([[5]]), past_key_values=small).logits
        big = new_cache(model, 128)
        lean(input_ids=torch.tensor([prompt]), past_key_values=big)
        b = lean(input_ids=torch.tensor([[5]]), past_key_values=big).logits
    assert torch.equal(a, b)


def test_a_wide_tree_past_the_row_limits_is_still_bitwise_ar():
    """100 nodes (> 12-row GEMM passes, > NATIVE_ROWS, masked so still native): the path's logits."""
    model = neox32(10)
    lean = LeanNeoX(model)
    prompt, path = [5, 9, 11, 40], [17, 23, 4, 8]
    tree = Tree.root_only(path[0])
    u = 0
    for tok in path[1:]:
        for sib in range(24):  # 24 siblings per level, the path's token among them
            v = tree.add(u, (tok + sib) % 100, -1.0)
            if sib == 0:
                nxt = v
        u = nxt
    tree, _ = flatten_bfs(tree)
    assert len(tree) > 64
    on_path = [0] + [i for i in range(1, len(tree)) if tree.tokens[i] == path[tree.depths[i]]
                     and all(tree.tokens[a] == path[tree.depths[a]] for a in _ancestors(tree, i))]
    with torch.inference_mode():
        cache, p, ar = prefill_and_ar(lean, model, prompt, path, capacity=256)
        logits = lean(input_ids=torch.tensor([tree.tokens]), attention_mask=KeyMask(p, ancestor_matrix(tree.parents)),
                      position_ids=position_ids(tree.depths, p), past_key_values=cache).logits[0]
    assert len(on_path) == len(path)
    assert all(torch.equal(logits[i], ar[tree.depths[i]]) for i in on_path)


def _ancestors(tree, i):
    while tree.parents[i] >= 0:
        i = tree.parents[i]
        yield i


def rounded(model, dtype):
    """The model with every parameter rounded to ``dtype`` and kept float32: what loading a bf16
    or fp16 checkpoint as float32 gives."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).float())
    return model


def test_weight_format_is_the_narrowest_exact_one(monkeypatch):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(8, 8, generator=g)
    assert native.weight_format([w]) == 0
    assert native.weight_format([w.bfloat16().float()]) == 1
    half = w.half().float()  # 11 significant bits: exact in fp16, not in bf16
    assert native.weight_format([half]) == 2
    assert native.weight_format([half, w.bfloat16().float()]) == 2  # one format holding every matrix
    assert native.weight_format([w * 1e6]) == 0  # beyond fp16's range and not bf16-exact
    bf = w.bfloat16().float()
    assert native.weight_format([bf]) == 1
    bf.mul_(1 + 2**-12)  # changed in place: the remembered answer goes with the tensor's version
    assert native.weight_format([bf]) == 0
    monkeypatch.setenv("DYNATREE_WEIGHTS16", "0")
    assert native.weight_format([w.bfloat16().float()]) == 0


def test_weight_format_reads_any_layout_and_every_chunk(monkeypatch):
    """The checks read a matrix in its storage order (models.cpu_layout keeps Linear weights as
    (in, out)), answer a view (a fused matrix's row block) for the tensor it views, and the half
    check, which goes a chunk at a time, sees a value in the last chunk."""
    monkeypatch.setattr(native, "_CHUNK", 7)
    g = torch.Generator().manual_seed(9)
    base = torch.randn(24, 16, generator=g)
    for fmt, dtype in ((1, torch.bfloat16), (2, torch.float16)):
        exact = base.to(dtype).float()
        stored_t = exact.t().contiguous().t()  # (24, 16) over (16, 24) storage
        assert native.weight_format([stored_t]) == fmt and native.weight_format([[stored_t[:5], stored_t[5:]]]) == fmt
        odd = exact.clone()
        odd[-1, -1] += odd[-1, -1].abs().clamp(min=1e-3) * 2**-20  # the last element: no 16-bit format holds it
        assert native.weight_format([odd]) == 0 and native.weight_format([odd[:3]]) == 0  # a view of it: asked of odd


@pytest.mark.parametrize("fmt", [0, 1])
def test_a_matrix_packs_the_same_from_its_row_blocks_in_either_layout(fmt):
    """A fused matrix given as row blocks (NeoX's q/k/v per head, Llama's q, k, v) packs to the
    same tiles as the matrix itself, padded or not, plain or stored transposed."""
    tw = native.library().dt_tile_width()
    g = torch.Generator().manual_seed(10)
    for n in (3 * tw, 3 * tw - 5):
        w = torch.randn(n, 40, generator=g).bfloat16().float()
        ref = native.PackedLinear(w, None, fmt)
        cuts = [0, 5, tw + 3, n]  # blocks that do not line up with the tiles
        for layout in (w, w.t().contiguous().t()):
            blocks = [layout[a:b] for a, b in zip(cuts, cuts[1:])]
            got = native.PackedLinear(blocks, None, fmt)
            assert got.n_out == n and torch.equal(got.packed, ref.packed)
        x = torch.randn(3, 40, generator=g)
        torch.testing.assert_close(ref(x).double(), x.double() @ w.double().t(), rtol=1e-5, atol=1e-5)


def test_a_16_bit_checkpoint_packs_in_half_the_bytes(monkeypatch):
    """The packed copy's budget (a quarter of the machine's memory) counts 2 bytes a weight where
    a 16-bit format holds every matrix exactly: a bf16 checkpoint twice the size still packs."""
    model, exact = neox32(3), neox32(3)
    with torch.no_grad():
        for p in exact.parameters():
            p.copy_(p.bfloat16().float())
    mats = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    assert native.packed_bytes(model) == 4 * mats and native.packed_bytes(exact) == 2 * mats
    monkeypatch.setattr(native, "MAX_PACKED_BYTES", 3 * mats)
    assert LeanNeoX(exact).native and not LeanNeoX(model).native
    assert "packed copy" in LeanNeoX(model).refusal and "quarter of this machine's memory" in LeanNeoX(model).refusal


@pytest.mark.parametrize("k", [40, 300])  # 300: long tiles, the prefetch running ahead into the next one
@pytest.mark.parametrize("dtype,fmt", [(torch.bfloat16, 1), (torch.float16, 2)])
def test_16_bit_weight_storage_gives_bitwise_float32_results(dtype, fmt, k):
    g = torch.Generator().manual_seed(8)
    w = torch.randn(72, k, generator=g).to(dtype).float()
    b = torch.randn(72, generator=g)
    x = torch.randn(40, k, generator=g)
    lin32, lin16 = native.PackedLinear(w, b, 0), native.PackedLinear(w, b, fmt)
    assert lin16.packed.element_size() == 2
    for m in (1, 7, 8, 12, 13, 14, 25, 40):
        y = lin16(x[:m])
        assert torch.equal(y, lin32(x[:m]))
        assert torch.equal(lin16(x[m - 1:m])[0], y[m - 1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_checkpoint_runs_16_bit_with_float32_logits(dtype, monkeypatch):
    model = rounded(neox32(9), dtype)
    lean16 = LeanNeoX(model)
    monkeypatch.setenv("DYNATREE_WEIGHTS16", "0")
    lean32 = LeanNeoX(model)
    assert (lean16.weight_format, lean32.weight_format) == ({torch.bfloat16: 1, torch.float16: 2}[dtype], 0)
    prompt, path = [5, 9, 11, 40, 2, 7], [17, 23, 4]
    with torch.inference_mode():
        _, _, ar16 = prefill_and_ar(lean16, model, prompt, path)
        _, _, ar32 = prefill_and_ar(lean32, model, prompt, path)
    assert all(torch.equal(a, b) for a, b in zip(ar16, ar32))
    target, draft = model, rounded(neox32(10, layers=1), dtype)
    monkeypatch.delenv("DYNATREE_WEIGHTS16")
    pair = pair_from_models(target, draft, None, eos_token_id=3)
    assert pair.runner("target").weight_format > 0
    ar, _, _ = decode(pair, prompt, make_config("ar"), max_new_tokens=30, ignore_eos=True)
    out, _, _ = decode(pair, prompt, make_config("dynatree"), max_new_tokens=30, ignore_eos=True)
    assert out == ar


@pytest.mark.parametrize("kernel", ["lean", "lean-mkl", "hf"])
def test_fused_heads_equal_a_scan_of_the_logits(kernel):
    """The draft's top-k and the target's argmax come out of the forward call; they must be what
    scanning its logits gives, on every runner."""
    target = neox32(11)
    pair = pair_from_models(target, neox32(12, layers=1), None, eos_token_id=3)
    pair.kernel = kernel
    run = pair.runner("target")
    with torch.inference_mode():
        cache = new_cache(target, 32)
        run(input_ids=torch.tensor([[5, 9, 11]]), past_key_values=cache)
        out = run(input_ids=torch.tensor([[40, 2]]), past_key_values=cache, topk=3, cols=90)
        assert out.top == native.topk_probs(out.logits[0, :, :90], 3)
        cache.truncate(3)
        out = run(input_ids=torch.tensor([[40, 2]]), past_key_values=cache, argmax=True)
        assert out.choice == out.logits[0].argmax(-1).tolist() and out.top is None


def test_packed_sequences_get_bitwise_their_own_logits():
    """Several sequences in one native forward (different prefix lengths; a tree, a chain, one
    token, a prompt joining with an empty cache): each gets bitwise the logits, heads and cache
    entries it gets alone."""

    model = neox32(11, layers=2)
    lean = LeanNeoX(model)
    alone, alone_caches, packed, packed_caches = alone_and_packed(model, lean)
    prefilled, steps = mixed_batch(model, lean)
    with torch.inference_mode():
        argmaxed = lean.forward(steps(prefilled()), argmax=True)
    for a, b, c in zip(alone, packed, argmaxed):
        assert torch.equal(a.logits, b.logits) and a.top == b.top
        assert c.choice == b.logits[0].argmax(-1).tolist()
    assert packed[3].logits.shape[1] == 1  # keep=1: the joining prompt's last row only
    for ca, cb in zip(alone_caches, packed_caches):
        assert ca.length == cb.length
        for la, lb in zip(ca.layers, cb.layers):
            assert torch.equal(la.keys[:, :, :ca.length], lb.keys[:, :, :cb.length])
            assert torch.equal(la.values[:, :, :ca.length], lb.values[:, :, :cb.length])


def test_profile_says_when_threads_share_cores(capsys, monkeypatch):
    """The FMA peak on N threads is printed beside one thread's, with a note when N threads reach
    well under N times it (vCPUs sharing a core: every timing after it reads slow)."""
    from dynatree.profiling import fma_peak_line

    for rates, note in (({1: 165.0, 2: 200.0}, True), ({1: 132.0, 2: 263.0}, False)):
        monkeypatch.setattr(native, "fma_peak", lambda threads, rates=rates: rates[threads])
        assert fma_peak_line(2) == rates[2]
        out, err = capsys.readouterr()
        assert f"{rates[2]:.1f} GFLOP/s on 2 threads ({rates[2] / rates[1]:.2f}x one thread's {rates[1]:.1f})" in out
        assert ("these CPUs share cores" in err) == note, err
        assert re.search(r"^CPU: .+\(.+\), \d+ CPUs$", out, re.M), out
    monkeypatch.setattr(native, "fma_peak", lambda threads: 99.0)
    assert fma_peak_line(1) == 99.0
    out, err = capsys.readouterr()
    assert "99.0 GFLOP/s on 1 thread\n" in out and not err


def test_profile_names_the_variant_peak_and_mkl_comparison(tmp_path, isa, monkeypatch):
    from click.testing import CliRunner

    from dynatree import kbuild
    from dynatree.cli import main

    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)

    for name, seed in (("target", 12), ("draft", 13)):
        neox32(seed).save_pretrained(tmp_path / name)
    res = CliRunner().invoke(main, ["profile", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
                                    "--device", "cpu", "--prefix", "16", "--prefill", "20", "--repeats", "1"])
    assert res.exit_code == 0, res.output
    out = res.output
    assert f"native kernel: {isa} variant" in out and "FMA peak of this variant, measured:" in out
    assert "target prefill of 20 tokens" in out
    # a batched step of 16 sequences, each over its own 16 cached tokens (2 layers x 64 keys and values
    # of float32 each: 16 KiB), against one sequence of 16 tokens
    assert re.search(r"^target, 16 sequences of 1 token over 16 cached tokens each: \d+\.\d\d ms, against \d+\.\d\d "
                     r"ms for one sequence of 16 tokens: [+-]\d\.\d{3} ms per extra sequence, reading its 0\.0 MiB",
                     out, re.M), out
    # a build that has VDPBF16PS measures its dot peak against the FMA's and says whether lean-bf16 pays
    assert ("this CPU's bfloat16 dot products measured" in out) == bool(native.library().dt_bf16_dot())
    # each model's per-extra-token rate against that peak -- or, when one --repeats on a busy host
    # timed the wider forward no slower, the line saying it was not measurable
    for name in ("target", "draft"):
        assert re.search(rf"^{name}: .*(% of the FMA peak|not measurable)", out, re.M), out
    # the kernels take turns (3 rounds by default): each ratio is the rounds' median, with their range
    line = next(l for l in out.splitlines() if l.startswith("target, native ÷ lean-mkl time"))
    assert "(median of 3 alternating rounds, range): 1 token " in line and "20-token prefill" in line
    assert re.search(r"1 token \d+\.\d\dx \(\d+\.\d\d-\d+\.\d\d\)", line), line
    # the draft too (the portable-kernel bounds are for both models), without a prefill
    line = next(l for l in out.splitlines() if l.startswith("draft, native ÷ lean-mkl time"))
    assert re.search(r"1 token \d+\.\d\dx .*16 tokens \d+\.\d\dx", line) and "prefill" not in line, line
    assert re.search(r"^lean-mkl draft +1: +\d+\.\d\d +4: +\d+\.\d\d +16: +\d+\.\d\d$", out, re.M), out
    # an AVX2 build on an AVX-512 CPU races an AVX-512 MKL: the note says how to compare as on an AVX2 CPU;
    # the generic (128-bit) build on an x86 CPU with AVX2 or AVX-512, as on a 128-bit one
    assert ("MKL_ENABLE_INSTRUCTIONS=AVX2" in out) == (isa == "avx2" and kbuild.has_avx512())
    wide = {"avx2", "avx512f"} & set(kbuild.cpu_flags().split()) if kbuild._X86 else set()
    assert ("MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41" in out) == (isa == "generic" and bool(wide))


def test_time_sequences_times_a_batched_step_against_a_tree(isa):
    """budget.time_sequences: n one-token sequences over their own caches, one n-token sequence over
    one, and the key/value bytes of a cache -- or None where it would not measure what it says."""
    from dynatree.budget import time_sequences

    lean = LeanNeoX(neox32(5))
    apart, together, kv, n = time_sequences(lean, 24, 4, 3)
    assert apart > 0 and together > 0 and n == 4
    assert kv == 2 * 2 * 4 * 24 * 16 * 4  # layers x (keys, values) x heads x cached x head_dim x float32
    assert time_sequences(lean, 24, 4, 1, "bfloat16")[2] == kv // 2
    assert time_sequences(lean, 24, 4, 1, max_bytes=3 * kv)[3] == 3  # as many caches as fit
    assert time_sequences(lean, 24, 4, 1, max_bytes=2 * kv - 1) is None  # not even two
    assert time_sequences(lean, 24, 1, 1) is None  # one sequence: nothing to compare
    lean.native = False  # torch's path: its GEMMs packed too, attention per sequence
    assert time_sequences(lean, 24, 4, 1)[3] == 4


def test_profile_sequences_line_says_when_fewer_caches_fit(capsys, monkeypatch):
    """A large model's caches: the profile times as many sequences as fit and says so, or says why
    it timed none."""
    from dynatree import budget
    from dynatree.profiling import _sequences_line

    runner = type("R", (), {"native": True})()
    monkeypatch.setattr(budget, "time_sequences", lambda *a: (5.0, 2.0, 2**20, 4))
    _sequences_line(runner, 256, 16, 3, "model")
    out = capsys.readouterr().out
    assert "4 sequences of 1 token over 256 cached tokens each (not 16: 16 caches would pass 1 GiB)" in out
    assert "+1.000 ms per extra sequence, reading its 1.0 MiB of keys and values, 1 GB/s" in out
    monkeypatch.setattr(budget, "time_sequences", lambda *a: None)
    _sequences_line(runner, 256, 16, 3, "model")
    assert "target, 16 sequences: not timed (two of their caches would pass 1 GiB)" in capsys.readouterr().out
    # torch's paths: what a sequence costs there is not (only) its cache's read
    monkeypatch.setattr(budget, "time_sequences", lambda *a: (5.0, 2.0, 2**20, 4))
    lean = LeanNeoX(neox32(5))
    lean.native = False
    _sequences_line(lean, 256, 4, 3, "model")
    assert "its attention, run apart on torch's path, over its 1.0 MiB of keys and values" in capsys.readouterr().out
    _sequences_line(type("HF", (), {"batch_problem": "", "joined_problem": ""})(), 256, 4, 3, "model")
    assert "transformers' padded forward, attention over its 1.0 MiB of keys and values" in capsys.readouterr().out
    _sequences_line(type("HF", (), {"batch_problem": "pads wrong", "joined_problem": ""})(), 256, 4, 3, "model")
    assert "transformers' joined forward, attention per sequence over its 1.0 MiB" in capsys.readouterr().out
    no_mask = "its forward takes no 4-D mask"
    _sequences_line(type("HF", (), {"batch_problem": no_mask, "joined_problem": no_mask})(), 256, 4, 3, "model")
    assert ("this runner decodes each sequence in a forward of its own (its forward takes no 4-D mask)"
            in capsys.readouterr().out)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
def test_concurrent_builders_wait_for_one_build(isa, monkeypatch, tmp_path):
    """Two builders of the same object (two actors starting on one machine) compile it once: the
    second waits on the first's lock, then loads its result."""
    import threading

    log = tmp_path / "compiles"
    wrapper = tmp_path / "cc-counting"
    wrapper.write_text(f'#!/bin/sh\ncase " $* " in *" -c "*) echo x >> {log};; esac\nexec cc "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("DYNATREE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(wrapper))
    results = []
    threads = [threading.Thread(target=lambda: results.append(kbuild.build(isa))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r[1] for r in results] == ["", ""] and results[0][0] == results[1][0] and results[0][0].exists()
    assert len(log.read_text().split()) == len(kbuild.OBJECTS)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
def test_extra_cflags_reach_the_build_and_its_key(monkeypatch, tmp_path):
    """DYNATREE_CFLAGS (a sanitizer build, say) is appended to the compiler's flags and keys the
    cached object, so a normal and a sanitized build never load each other."""
    seen = []
    monkeypatch.setattr(kbuild, "_compile", lambda cc, flags, out: seen.append(flags))  # None: built
    monkeypatch.setenv("DYNATREE_CACHE", str(tmp_path))
    monkeypatch.delenv("DYNATREE_CFLAGS", raising=False)
    plain, _ = kbuild.build("generic")
    monkeypatch.setenv("DYNATREE_CFLAGS", "-g  -DDT_TEST=1")
    extra, _ = kbuild.build("generic")
    assert plain != extra and seen[1][-2:] == ["-g", "-DDT_TEST=1"] and "-g" not in seen[0]


def test_a_damaged_cached_object_is_built_again(monkeypatch, tmp_path):
    """A truncated object in the cache (copied, or on a network filesystem) crashed every process
    that loaded it with a bus error, and `dynatree build` called it built: its digest, kept beside
    it, no longer matches, so it is built again; an older version's object (no digest) is kept."""
    fake = tmp_path / "fake-cc"  # writes a file where -o says
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] && echo fake 1.0 && exit 0\n'
                    'while [ $# -gt 0 ]; do [ "$1" = -o ] && echo a-whole-object > "$2"; shift; done\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("DYNATREE_CACHE", str(tmp_path / "cache"))
    lib, why = kbuild.build("generic")
    assert lib is not None and lib.read_text() == "a-whole-object\n", why
    lib.write_text("a-who")  # truncated
    again, _ = kbuild.build("generic")
    assert again == lib and lib.read_text() == "a-whole-object\n"  # (built again, not trusted)
    kbuild._digest_path(lib).unlink()  # no digest (an older version's, or copied without it): not an ELF
    lib.write_text("older")  # object that holds its section headers, so built again (a bus error before)
    assert kbuild.build("generic")[0] == lib and lib.read_text() == "a-whole-object\n"
    real = Path(torch._C.__file__).read_bytes()  # (a whole ELF object of this machine)
    for data, kept in ((real, True), (real[:len(real) * 2 // 3], False)):
        kbuild._digest_path(lib).unlink(missing_ok=True)
        lib.write_bytes(data)
        assert (kbuild.build("generic")[0].read_bytes() == data) is kept
    monkeypatch.setenv("CC", f"env {fake}")  # a compiler command with words, as make takes it (was "no C compiler")
    monkeypatch.setenv("DYNATREE_CACHE", str(tmp_path / "cache2"))
    lib, why = kbuild.build("generic")
    assert lib is not None and lib.read_text() == "a-whole-object\n", why
    stale = tmp_path / "cache2" / "build-killed.so"  # a SIGKILLed build's object: swept once old
    stale.write_text("x")
    os.utime(stale, (0, 0))
    lib.unlink()
    kbuild.build("generic")
    assert not stale.exists()


def test_the_cache_directory_without_a_home_or_with_an_empty_variable(monkeypatch, tmp_path):
    """DYNATREE_CACHE empty is unset and ~ in it is the home (the cache had gone to the current
    directory, or to one named "~"); no home at all -- a container's user without a passwd entry
    -- is a directory in the temporary one (every command had crashed, DYNATREE_CACHE set or not)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("DYNATREE_CACHE", "")
    assert kbuild.cache_dir() == tmp_path / ".cache" / "dynatree"
    monkeypatch.setenv("DYNATREE_CACHE", "~/dt")
    assert kbuild.cache_dir() == tmp_path / "dt"

    def homeless():
        raise RuntimeError("Could not determine home directory.")
    monkeypatch.setattr(Path, "home", staticmethod(homeless))
    monkeypatch.setattr(os.path, "expanduser", lambda p: homeless())
    monkeypatch.setenv("DYNATREE_CACHE", str(tmp_path / "c"))
    assert kbuild.cache_dir() == tmp_path / "c"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    own = tmp_path / "tmp" / f"dynatree-{os.getuid()}"
    monkeypatch.setenv("DYNATREE_CACHE", "~/dt")  # (no home to put it in: not ./~/dt)
    assert kbuild.cache_dir() == own
    monkeypatch.delenv("DYNATREE_CACHE")
    assert kbuild.cache_dir() == own and own.stat().st_mode & 0o777 == 0o700
    own.chmod(0o777)  # a directory others may write (objects loaded from it would run their code): not used
    kbuild._process_tmp.cache_clear()
    try:
        assert kbuild.cache_dir() != own and kbuild.cache_dir().stat().st_mode & 0o777 == 0o700
    finally:
        kbuild._process_tmp.cache_clear()


def test_an_interrupted_build_leaves_no_compiler_nor_object(monkeypatch, tmp_path):
    """Ctrl-C or SIGTERM mid-build (a command's KeyboardInterrupt): the compilers are ended, their
    children too (a killed driver left cc1 running), and no temporary object stays in the cache."""
    import subprocess
    import time

    slow = tmp_path / "slow-cc"  # answers --version; a compile is a shell waiting on its own child
    slow.write_text('#!/bin/sh\n[ "$1" = --version ] && echo slow 1.0 && exit 0\nsleep 60 &\nwait\n')
    slow.chmod(0o755)
    monkeypatch.setenv("CC", str(slow))
    monkeypatch.setenv("DYNATREE_CACHE", str(tmp_path / "cache"))
    spawned, real = [], subprocess.Popen

    class Interrupted(real):  # (the interrupt lands while the build waits on its compilers)
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            spawned.append(self)

        def communicate(self, *a, **k):
            time.sleep(0.3)  # (the shell has started its child)
            raise KeyboardInterrupt

    monkeypatch.setattr(kbuild.subprocess, "Popen", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        kbuild.build("generic")
    assert spawned and all(p.poll() is not None for p in spawned)
    assert not list((tmp_path / "cache").glob("*.so"))  # (the temporary object went with the build)
    time.sleep(0.2)
    left = [pid for p in spawned for pid in _live_in_group(p.pid)]  # (the shells' `sleep 60` children)
    assert not left, left


def test_a_build_writes_only_where_the_cache_is(monkeypatch, tmp_path):
    """Python's temporary directory unusable (a full /tmp: "No usable temporary directory", which
    the build reported as "cannot build in ...: No such file or directory") does not fail a build:
    its objects lie beside the cache and the compiler pipes instead of writing assembler files."""
    src = tmp_path / "tiny.c"
    src.write_text("int dt_tiny(void) { return 1; }\n")
    monkeypatch.setattr(kbuild, "OBJECTS", [(src, [])])
    monkeypatch.setattr(kbuild.tempfile, "tempdir", str(tmp_path / "gone"))  # (what gettempdir() answers)
    out = tmp_path / "cache" / "lib.so"
    out.parent.mkdir()
    assert kbuild._compile(shlex.split(os.environ.get("CC") or "cc"), kbuild.FLAGS, str(out)) is None
    assert [p.name for p in out.parent.iterdir()] == ["lib.so"]  # (the objects' directory went with the build)
    killed, live = out.parent / "build-killed", out.parent / "build-live"  # (a SIGKILLed build's stays: cleared
    for d in (killed, live):                                                # once older than any build takes)
        (d / "0-tiny.o").parent.mkdir()
        (d / "0-tiny.o").write_text("")
    os.utime(killed, (0, 0))
    assert kbuild._build_into(out.parent, "k", shlex.split(os.environ.get("CC") or "cc"), kbuild.FLAGS)[0] is not None
    assert not killed.exists() and live.exists()


def _live_in_group(pgid: int) -> list[int]:
    """The live (not zombie) pids of process group ``pgid``, from /proc/*/stat (state, ppid, pgrp)."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            state, _ppid, group = (d / "stat").read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(group) == pgid and state != "Z":
            pids.append(int(d.name))
    return pids


def test_build_command_builds_ahead_and_reports_failures(monkeypatch, tmp_path):
    """`dynatree build` compiles each requested variant into the cache (a fake compiler here: the
    real build is tested above) and says which could not be built."""
    from click.testing import CliRunner

    from dynatree.cli import main

    fake = tmp_path / "cc-fake"
    fake.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = "-o" ] && echo obj > "$2"; shift; done\n')
    fake.chmod(0o755)
    monkeypatch.setenv("DYNATREE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(fake))
    res = CliRunner().invoke(main, ["build", "--isa", "all"])
    assert res.exit_code == 0, res.output
    built = [line.split(": ")[1].split(" (")[0] for line in res.output.splitlines()]
    assert len(built) == len(kbuild.variants_here()) and all(Path(p).exists() for p in built)
    default = built[kbuild.variants_here().index(kbuild.variant())]  # DYNATREE_ISA's, or native
    assert CliRunner().invoke(main, ["build"]).output.split(" (")[0].endswith(default)
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("DYNATREE_CACHE", str(tmp_path / "cache2"))
    res = CliRunner().invoke(main, ["build", "--isa", "generic"])
    assert res.exit_code != 0 and "generic: not built: false failed" in res.output
    res = CliRunner().invoke(main, ["build"])  # the install step on a machine without a compiler: a warning
    assert res.exit_code == 0 and "not built: false failed" in res.output
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("DYNATREE_CACHE", str(tmp_path / "a-file" / "cache"))  # a cache that cannot be made: said
    res = CliRunner().invoke(main, ["build", "--isa", "generic"])
    assert res.exit_code != 0 and "generic: not built: cannot build in" in res.output and res.exception is not None
    assert isinstance(res.exception, SystemExit)  # (no traceback)
    res = CliRunner().invoke(main, ["build", "--isa", "avx9"])  # a typo: said as the flag typed, nothing built
    assert res.exit_code != 0 and "--isa avx9: choose native, avx2, generic or all" in res.output
    monkeypatch.setenv("DYNATREE_ISA", "avx512")  # a variant named in the environment must build, or say so
    res = CliRunner().invoke(main, ["build"])
    assert res.exit_code != 0 and "DYNATREE_ISA='avx512': choose native, avx2, generic" in res.output
    monkeypatch.setenv("DYNATREE_ISA", "avx2")  # ... as one this CPU cannot run (an install step had passed)
    monkeypatch.setattr(kbuild, "variants_here", lambda: ["native", "generic"])
    res = CliRunner().invoke(main, ["build"])
    assert res.exit_code != 0 and "DYNATREE_ISA=avx2 cannot run on this CPU: choose native, generic" in res.output


@pytest.mark.parametrize("arch", ["neox", "qwen3"])
def test_a_long_prefill_in_chunks_is_bitwise_one_pass(arch, monkeypatch):
    """A prompt longer than NATIVE_ROWS, keeping one row's logits (a prefill), runs through the
    kernel in chunks: the same cache and logits, bit for bit, as one pass (batch invariance), and
    not the torch path; one keeping every row's logits still takes torch."""
    import dynatree.cmodel
    from dynatree.packed import PackedRunner
    from test_packed import llama32

    model = neox32(4) if arch == "neox" else llama32("qwen3", 4)
    run = LeanNeoX(model) if arch == "neox" else PackedRunner(model)
    prompt = torch.tensor([[(7 * i) % 97 for i in range(50)]])
    got = []
    for rows in (1000, 16):  # one pass; then chunks of 16, 16, 2 and the last 16 rows
        monkeypatch.setattr(dynatree.cmodel, "NATIVE_ROWS", rows)
        cache = new_cache(model, 8)
        with torch.inference_mode():
            out = run(input_ids=prompt, past_key_values=cache, logits_to_keep=1, argmax=True)
        got.append((out.logits, out.choice, cache))
    (a, ca, cache_a), (b, cb, cache_b) = got
    assert torch.equal(a, b) and ca == cb and cache_a.length == cache_b.length == 50
    for la, lb in zip(cache_a.layers, cache_b.layers):
        assert torch.equal(la.keys[:, :, :50], lb.keys[:, :, :50]) and torch.equal(la.values[:, :, :50], lb.values[:, :, :50])
    calls = []
    monkeypatch.setattr(type(run), "_torch", lambda self, *a: calls.append(a) or [None])
    with torch.inference_mode():
        run.forward([Seq(prompt[0], new_cache(model, 8), keep=1)])
        assert calls == []
        run.forward([Seq(prompt[0], new_cache(model, 8))])  # every row's logits: torch's
    assert len(calls) == 1


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
def test_a_tree_spanning_three_key_blocks_is_bitwise_ar():
    """head_dim 16: 256-key blocks.  A 251-token prompt and a 13-level tree of 23 siblings per level
    put a deep path node's keys in three blocks, the first two with odd counts (253 and 11): its
    logits must still be bitwise the AR step's."""
    torch.manual_seed(4)
    cfg = GPTNeoXConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=1024, rotary_pct=0.5, initializer_range=0.3,
                        use_parallel_residual=True, tie_word_embeddings=False, eos_token_id=3, bos_token_id=3)
    model = GPTNeoXForCausalLM(cfg).float().eval()
    lean = LeanNeoX(model)
    if not getattr(lean, "native", False):
        pytest.skip("native kernel unavailable")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(4, 100, (251,), generator=g).tolist()
    path = torch.randint(4, 100, (14,), generator=g).tolist()
    tree = Tree.root_only(path[0])
    u = 0
    for tok in path[1:]:
        nxt = None
        for sib in range(23):
            v = tree.add(u, (tok + sib) % 100, -1.0)
            nxt = v if sib == 0 else nxt
        u = nxt
    tree, _ = flatten_bfs(tree)
    deep = u  # level-wise growth is BFS already: indices unchanged
    with torch.inference_mode():
        cache = new_cache(model, 1024)
        lean(input_ids=torch.tensor([prompt]), past_key_values=cache)
        p = cache.length
        ar = [lean(input_ids=torch.tensor([[t]]), past_key_values=cache).logits[0, -1] for t in path]
        cache.truncate(p)
        logits = lean(input_ids=torch.tensor([tree.tokens]), attention_mask=KeyMask(p, ancestor_matrix(tree.parents)),
                      position_ids=position_ids(tree.depths, p), past_key_values=cache).logits[0]
    assert tree.depths[deep] == 13 and p + deep > 512
    assert torch.equal(logits[deep], ar[13])


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
@pytest.mark.parametrize("isa", native.variants_here())
def test_bf16_cache_rounds_exact_ties_to_even(isa, monkeypatch):
    """put_kv's float32 -> bfloat16 must be torch's round-to-nearest-*even*.  Random activations
    almost never land on an exact tie (low 16 bits 0x8000), so the existing rounding test cannot
    tell ties-to-even from ties-away; here every cached value is a tie: the value projection's
    weights are zero and its bias holds ties of both parities and signs."""
    monkeypatch.setenv("DYNATREE_ISA", isa)
    model = neox32(5, layers=1)
    hd, heads = 16, 4
    ties = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x40A08000, 0x3E7F8000],
                        dtype=torch.int64).to(torch.int32).view(torch.float32)  # even and odd kept lsb, +/-
    vals = ties.repeat(hd)[:hd]
    with torch.no_grad():
        qkv = model.gpt_neox.layers[0].attention.query_key_value
        for h in range(heads):  # NeoX's fused rows: per head [q | k | v]
            v_rows = slice(h * 3 * hd + 2 * hd, (h + 1) * 3 * hd)
            qkv.weight[v_rows] = 0.0
            qkv.bias[v_rows] = vals
    lean = LeanNeoX(model)
    assert lean.native
    cache = new_cache(model, 16, "bfloat16")
    with torch.inference_mode():
        lean(input_ids=torch.tensor([[5, 9, 11]]), past_key_values=cache)
    got = cache.layers[0].values[0, :, :3]  # (heads, 3 tokens, hd)
    assert got.dtype == torch.bfloat16
    want = vals.to(torch.bfloat16).expand_as(got)  # torch: ties to even
    assert torch.equal(got, want), (got[0, 0].view(torch.int16), want[0, 0].view(torch.int16))


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
def test_packed_sampled_sequences_each_use_their_own_temperature():
    """Each sequence packed into one forward perturbs its kept rows with *its own* 1/temperature
    (dt_seq.inv_temp): its fused draws and proposals are what it gets alone.  The existing batch
    tests give every neighbour the same temperature, so a kernel reading the first sequence's
    temperature for all rows passed them."""
    from dynatree.runtime import Seq
    from dynatree.sampling import Sampler

    model = neox32(12, layers=1)
    lean = LeanNeoX(model)
    assert lean.native
    prompts = [[5, 9, 11, 40], [7, 2, 60, 61, 3]]
    samplers = [Sampler(1.0, 0, 1.0, 11), Sampler(0.05, 0, 1.0, 12)]  # very different temperatures
    depths = [0, 1, 2]

    def seq(i, cache):
        return Seq(torch.tensor([17, 23, 4]), cache, keep=3, perturb=samplers[i].head(depths))

    def primed(i):
        cache = new_cache(model, 32)
        lean.forward([Seq(torch.tensor(prompts[i]), cache)])
        return cache

    with torch.inference_mode():
        for mode in ({"argmax": True}, {"topk": 3, "cols": 90}):
            alone = [lean.forward([seq(i, primed(i))], **mode)[0] for i in range(2)]
            both = lean.forward([seq(0, primed(0)), seq(1, primed(1))], **mode)
            for a, b in zip(alone, both):
                assert a.choice == b.choice and a.top == b.top
                assert torch.equal(a.logits, b.logits)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
def test_topk_probabilities_are_exact_with_the_maximum_in_the_row_tail():
    """softmax_topk_rows subtracts the row's max before exp (vmax_row).  A max left out of it --
    the remainder past the last whole vector -- overflows exp: probabilities NaN instead of 1."""
    x = torch.zeros(2, 37)
    x[0, 36] = 100.0  # in the tail for 16-, 8- and 4-float vectors (37 = 32 + 5 = 36 + 1)
    x[1, 33] = 100.0
    vals, ids = native.topk_probs(x, 2)
    assert ids == [[36, 0], [33, 0]]
    assert [v[0] for v in vals] == [1.0, 1.0]


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
def test_every_variant_computes_the_same_topk_probabilities():
    """The draft's top-k confidences shape the tree: on every kernel variant they must be the same
    bits, as the logits are (test_native only compares logits across variants).  The max sits
    where the variants' vector loops end differently (992..995: AVX-512's tail, generic's vector)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 999, generator=g)
    for r, at in enumerate((992, 993, 994, 995, 996, 997, 998, 500)):
        x[r, at] = 4.0
    seen = {}
    for v in native.variants_here():
        lib = native.library(v)
        vals, ids = torch.empty(8, 5), torch.empty(8, 5, dtype=torch.long)
        lib.dt_softmax_topk(x.data_ptr(), 8, 999, 999, 5, vals.data_ptr(), ids.data_ptr())
        seen[v] = vals, ids
    assert len(seen) >= 2
    first = next(iter(seen.values()))
    for v, (vals, ids) in seen.items():
        assert torch.equal(ids, first[1]) and torch.equal(vals, first[0]), v


def test_a_sequence_the_c_forward_leaves_to_torch_keeps_its_sampling_heads():
    """A packed forward the C kernel takes only in part -- a sequence whose cache stores float16,
    which the kernel does not read, beside one it takes -- runs sequence by sequence
    (runtime.forward_each), and each sequence there keeps its own kept rows and its sampling
    heads' Perturb: a sampled sequence draws in the batch what it draws alone, not the plain
    argmax of its logits."""
    from dataclasses import replace

    from dynatree.sampling import Sampler

    model = neox32(12, layers=1)
    lean = LeanNeoX(model)
    assert lean.native
    s = Sampler(1.0, 0, 1.0, 11)

    def primed(kv_dtype):
        cache = new_cache(model, 32, kv_dtype)
        lean.forward([Seq(torch.tensor([5, 9, 11, 40]), cache)])
        return cache

    def seqs():
        return [Seq(torch.tensor([17, 23, 4]), primed("float16"), keep=3, perturb=s.head([0, 1, 2])),
                Seq(torch.tensor([7, 2]), primed("model"), keep=1)]

    with torch.inference_mode():
        alone = lean.forward(seqs()[:1], argmax=True)[0]
        plain = lean.forward([replace(seqs()[0], perturb=None)], argmax=True)[0]
        both = lean.forward(seqs(), argmax=True)
    assert alone.choice != plain.choice  # the noise moves the draws: the comparison can tell
    assert both[0].choice == alone.choice and torch.equal(both[0].logits, alone.logits)
    assert both[1].logits.shape[1] == 1 and len(both[1].choice) == 1
