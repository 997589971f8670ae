"""StreamingLLM's cache window (kv_window / kv_sinks / kv_evict): eviction re-rotates keys to their
new positions, caches stay bounded, and every greedy method equals `ar` with the same window."""
import shutil

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from dynatree import decode, make_config, native
from dynatree.config import ar_reference
from dynatree.engine import BatchDecoder, ContextError, decode_batch
from dynatree.kvcache import BufferLayer, make_window
from dynatree.models import pair_from_models

from conftest import EOS, noisy_copy, random_prompts, tiny_neox
from test_batched import METHODS, f32_pair

W = {"kv_window": 40, "kv_sinks": 4, "kv_evict": 8}


def with_window(opts, window=W):
    return {**opts, **window}


def rotate(x, pos, inv_freq):
    """x: (1, 1, n, r) rotated to positions pos (n,) the way GPT-NeoX does (rotate_half)."""
    ang = pos[:, None].double() * inv_freq[None].double()
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def test_evict_turns_keys_to_their_new_positions(target):
    """After dropping `chunk` tokens behind the sinks, a kept key equals its pre-rotary key rotated
    at its new position (the StreamingLLM rule); the unrotated dims, values and sinks just move."""
    win = make_window(target, 12, 2, 3)
    r = win.cos.shape[-1]
    inv_freq = target.gpt_neox.rotary_emb.inv_freq
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(1, 1, 10, r + 4, generator=g, dtype=torch.float64)  # (b, h, n, d)
    pos = torch.arange(10)
    keys = torch.cat((rotate(raw[..., :r], pos, inv_freq), raw[..., r:]), -1)
    values = torch.randn(1, 1, 10, r + 4, generator=g, dtype=torch.float64)
    layer = BufferLayer(16)
    layer.update(keys, values)
    layer.evict(2, 3, win.cos, win.sin)
    assert layer.length == 7
    kept = [0, 1] + list(range(5, 10))
    expect = torch.cat((rotate(raw[..., kept, :r], torch.arange(7), inv_freq), raw[..., kept, r:]), -1)
    torch.testing.assert_close(layer.keys[:, :, :7], expect, rtol=0, atol=1e-12)
    assert torch.equal(layer.values[:, :, :7], values[:, :, kept])


def test_a_bfloat16_cache_is_turned_in_float32_and_rounded_once(target):
    """A bfloat16 cache's keys are re-rotated from their stored values in (at least) float32 and
    rounded once: what the exact turn of those values rounds to, not the drift of a turn whose
    every product is rounded to bfloat16."""
    win = make_window(target, 12, 2, 3)
    r = win.cos.shape[-1]
    g = torch.Generator().manual_seed(1)
    keys, values = torch.randn(1, 2, 10, r + 4, generator=g), torch.randn(1, 2, 10, r + 4, generator=g)
    layer = BufferLayer(16, torch.bfloat16)
    layer.update(keys, values)
    stored = layer.keys[:, :, :10].double()
    layer.evict(2, 3, win.cos, win.sin)
    kept = [0, 1] + list(range(5, 10))
    k = stored[:, :, kept]
    half = r // 2
    turned = k[..., :r] * win.cos - torch.cat((-k[..., half:r], k[..., :half]), -1) * win.sin
    turned[:, :, :2] = k[:, :, :2, :r]  # the sinks stay where they are
    assert torch.equal(layer.keys[:, :, :7], torch.cat((turned, k[..., r:]), -1).to(torch.bfloat16))


def test_make_room_drops_the_oldest_chunk_after_the_sinks(target):
    """A full cache loses the chunk right after the sinks: the sinks and the newest tokens stay,
    in order; chunks go until the incoming tokens fit, down to the sinks alone."""
    from dynatree.kvcache import BufferCache

    win = make_window(target, 8, 2, 3)
    cache = BufferCache(1, 16)
    slot = torch.arange(8, dtype=torch.float64).view(1, 1, 8, 1).expand(1, 1, 8, win.cos.shape[-1] + 2)
    cache.layers[0].update(slot.clone(), slot.clone())  # values: each token's own index
    assert win.make_room(cache, 1) == 3  # 8 + 1 > 8
    assert cache.layers[0].values[0, 0, :cache.length, 0].tolist() == [0, 1, 5, 6, 7]
    assert win.make_room(cache, 3) == 0  # 5 + 3 fits exactly
    assert win.make_room(cache, 4) == 3  # 5 + 4 does not: one chunk more leaves the sinks alone
    assert cache.layers[0].values[0, 0, :cache.length, 0].tolist() == [0, 1]


def test_windowed_methods_equal_windowed_ar_float64(close_pair):
    """Torch path, float64: with the same window every method gives windowed ar's tokens, past the
    models' 128-token context, with a prompt longer than the window (prefilled in pieces) and rows
    of different methods in one batch."""
    prompts = random_prompts(3, seed=41, lo=5, hi=30) + random_prompts(1, seed=42, lo=70, hi=70)
    refs = [decode(close_pair, p, make_config("ar", W), max_new_tokens=150, ignore_eos=True)[0] for p in prompts]
    assert all(len(r) == 150 for r in refs)
    plain = decode(close_pair, prompts[0], make_config("ar"), max_new_tokens=100, ignore_eos=True)[0]
    assert plain != refs[0][:100]  # the window changes what is generated: the test compares like with like
    for method, opts in METHODS[1:]:
        got = [decode(close_pair, p, make_config(method, with_window(opts)), max_new_tokens=150, ignore_eos=True)[0]
               for p in prompts[:2]]
        assert got == refs[:2], (method, opts)
    cfgs = [make_config(m, with_window(o)) for m, o in METHODS[:len(prompts)]]
    assert [t for t, _, _ in decode_batch(close_pair, prompts, cfgs, max_new_tokens=150, ignore_eos=True)] == refs


@pytest.mark.parametrize("opts", [{}, {"temperature": 0.9, "seed": 3}])
def test_a_draft_restarted_on_the_prompts_end_keeps_to_the_window(close_pair, opts):
    """draft_context shorter than the prompt, under a window: the draft restarts on the prompt's
    end and then fills and evicts on its own schedule, not the target's (its cache could be full
    when a windowed prefill began, which fed an empty piece and failed the row)."""
    prompts = random_prompts(2, seed=43, lo=70, hi=70)
    refs = [decode(close_pair, p, make_config("ar", with_window(opts)), max_new_tokens=150, ignore_eos=True)[0]
            for p in prompts]
    ctxs = range(3, 40, 4)
    for method in ("dynatree", "linear", "dyspec"):
        for ctx in ctxs[::3]:  # alone (the B = 1 case) ...
            cfg = make_config(method, with_window({**opts, "draft_context": ctx}))
            got = [decode(close_pair, p, cfg, max_new_tokens=150, ignore_eos=True)[0] for p in prompts]
            assert got == refs, (method, ctx)
        # ... and every draft_context, each row its own, in one batch
        cfgs = [make_config(method, with_window({**opts, "draft_context": ctx})) for ctx in ctxs for _ in prompts]
        got = [t for t, _, _ in decode_batch(close_pair, prompts * len(ctxs), cfgs, max_new_tokens=150, ignore_eos=True)]
        assert got == refs * len(ctxs), method


def test_windowed_speculation_still_speculates(same_pair):
    """Trees are clipped at the window's end only: an identical draft still commits several tokens
    per iteration through the evictions."""
    p = random_prompts(1, seed=43, lo=10, hi=10)[0]
    toks, _, m = decode(same_pair, p, make_config("linear", with_window({"k": 4})), max_new_tokens=120, ignore_eos=True)
    assert toks == decode(same_pair, p, make_config("ar", W), max_new_tokens=120, ignore_eos=True)[0]
    assert m.tokens_per_iteration > 3


def test_a_window_that_never_fills_changes_nothing(close_pair):
    p = random_prompts(1, seed=44, lo=10, hi=10)[0]
    big = {"kv_window": 100, "kv_sinks": 4, "kv_evict": 8}
    for method in ("ar", "dynatree"):
        assert (decode(close_pair, p, make_config(method, big), max_new_tokens=60)[0]
                == decode(close_pair, p, make_config(method), max_new_tokens=60)[0])


def test_caches_stay_inside_the_window(close_pair):
    """Between iterations the target cache holds less than the window (room for the root) and the
    draft's at most the window plus the accepted drafted nodes it keeps until its next feed; buffers
    are allocated for the window and the tree, not the generation."""
    dec = BatchDecoder(close_pair)
    dec.add(random_prompts(1, seed=45, lo=50, hi=50)[0], make_config("dynatree", with_window({"hw_budget": "off"})),
            max_new_tokens=200, ignore_eos=True)
    longest = 0
    while dec:
        dec.step()
        for r in dec.active:
            assert r.cache.length <= W["kv_window"] - 1 and r.drafter.cache.length <= W["kv_window"] + 8  # d_max
            longest = max(longest, r.cache.layers[0].capacity, r.drafter.cache.layers[0].capacity)
    assert longest <= W["kv_window"] + 256 + 8  # the window, the node budget and a margin; never grown


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
@pytest.mark.parametrize("isa,batch", [(v, 1) for v in native.variants_here()] + [("native", 3)])
def test_windowed_native_greedy_is_windowed_ar(isa, batch, monkeypatch):
    """Native kernel, float32, no tolerance: windowed methods equal windowed ar exactly on every
    kernel variant this CPU runs (native, avx2, generic) and at any batch size."""
    monkeypatch.setenv("DYNATREE_ISA", isa)
    pair = f32_pair()
    assert pair.runner("target").native
    prompts = random_prompts(3, seed=46, lo=5, hi=50)
    refs = [decode(pair, p, make_config("ar", W), max_new_tokens=90, ignore_eos=True)[0] for p in prompts]
    for method, opts in METHODS[1:5]:
        for at in range(0, len(prompts), batch):
            got = decode_batch(pair, prompts[at:at + batch], make_config(method, with_window(opts)),
                               max_new_tokens=90, ignore_eos=True)
            assert [t for t, _, _ in got] == refs[at:at + batch], (method, opts, batch)


def test_windowed_transformers_kernel(target):
    """transformers' own forward (`--kernel hf`) takes the same window."""
    pair = pair_from_models(target, noisy_copy(target, 7, 0.04), None, eos_token_id=EOS, kernel="hf")
    p = random_prompts(1, seed=47, lo=8, hi=8)[0]
    ref = decode(pair, p, make_config("ar", W), max_new_tokens=70, ignore_eos=True)[0]
    assert decode(pair, p, make_config("dynatree", with_window({"hw_budget": "off"})), max_new_tokens=70,
                  ignore_eos=True)[0] == ref


def test_windowed_sampling_is_reproducible(close_pair):
    p = random_prompts(1, seed=48, lo=8, hi=8)[0]
    cfg = make_config("dynatree", with_window({"temperature": 0.9, "seed": 5}))
    a = decode(close_pair, p, cfg, max_new_tokens=80, ignore_eos=True)[0]
    assert len(a) == 80 and a == decode(close_pair, p, cfg, max_new_tokens=80, ignore_eos=True)[0]
    assert a == decode(close_pair, p, ar_reference(cfg), max_new_tokens=80, ignore_eos=True)[0]


def test_window_errors(close_pair):
    with pytest.raises(ValueError, match="must exceed kv_sinks"):
        make_config("ar", {"kv_window": 10, "kv_sinks": 4, "kv_evict": 6})
    with pytest.raises(ValueError, match="kv_window must be >= 0"):
        make_config("ar", {"kv_window": -1})
    # without a window they do nothing, and are still accepted: a job made with one must stay resumable
    # (a session refused them and an earlier one had undone that for this reason; check and bench
    # refuse a shared one that no method's window takes: bench.parse_methods)
    assert make_config("dynatree", {"kv_evict": 16}).kv_evict == 16
    with pytest.raises(ContextError, match="exceed the models' 128-token context"):
        decode(close_pair, [5, 6], make_config("ar", {"kv_window": 100, "kv_evict": 40}), max_new_tokens=4)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    with pytest.raises(ValueError, match="rotary positions"):
        decode(pair_from_models(gpt2, None, None), [5, 6], make_config("ar", W), max_new_tokens=4)


def test_check_compares_windowed_rows_with_windowed_ar(close_pair):
    """`dynatree check` (and the job's ar reference, ar_reference) compare a windowed method with
    ar under the same window, not with plain ar, whose text the window changes."""
    from dynatree.check import check_methods
    from dynatree.config import ARConfig, ar_reference

    assert ar_reference(make_config("dynatree", W)) == make_config("ar", W)
    assert ar_reference(make_config("dynatree", {"d0": 3})) == ARConfig()
    prompts = random_prompts(2, seed=49, lo=20, hi=30)
    rows = check_methods(close_pair, prompts, {"dyn_w": make_config("dynatree", W), "dyn": make_config("dynatree")},
                         max_new_tokens=60)
    assert [r["method"] for r in rows] == ["ar", "ar_window40_evict8", "dyn_w", "dyn"] * 2
    assert [r["matches_ar"] for r in rows] == [None, None, True, True] * 2  # (references check nothing)
    # an ar method given a label keeps it, whether it comes before or after a method it is the reference of
    s = {"temperature": 0.9, "seed": 5}
    methods = {"ar_s": make_config("ar", s), "dyn": make_config("dynatree", s), "ar_s2": make_config("ar", s)}
    rows = check_methods(close_pair, prompts[:1], methods, max_new_tokens=10)
    assert [r["method"] for r in rows] == ["ar", "ar_s", "dyn", "ar_s2"]
    assert [r["matches_ar"] for r in rows] == [None, None, True, None]
    assert rows[1]["tokens_per_s"] == rows[3]["tokens_per_s"]  # decoded once


def test_job_prompts_under_a_window_are_not_cut_to_the_context():
    from dynatree.actors.worker import prompt_ids

    class Pair:
        max_context = 64

        def encode(self, text, last=None):  # (ModelPair.encode: at most the last `last` tokens)
            ids = list(range(len(text.split())))
            return ids[-last:] if last else ids

    text = "word " * 100
    assert len(prompt_ids(Pair(), text, 500, None, windowed=True)) == 100
    assert len(prompt_ids(Pair(), text, 500, 30, windowed=True)) == 30
    with pytest.raises(ValueError, match="does not fit"):
        prompt_ids(Pair(), text, 500, None)
    with pytest.raises(ValueError, match="not UTF-8 text"):  # a .txt input that is not UTF-8 (data.py)
        prompt_ids(Pair(), b"caf\xe9", 5, None)
    assert len(prompt_ids(Pair(), "word word".encode(), 5, None)) == 2  # a binary column's UTF-8 is text


def test_cli_generate_and_check_compare_with_windowed_ar(pair_dirs, tmp_path):
    """`dynatree generate --check-ar` and `dynatree check` judge a windowed method against ar with
    the same window (the float32 tiny pair runs the native kernel where it builds)."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq
    from click.testing import CliRunner

    from dynatree.cli import main

    pair = ["--target", str(pair_dirs / "target"), "--draft", str(pair_dirs / "draft"), "--device", "cpu"]
    win = ["--option", "kv_window=24", "--option", "kv_evict=4"]
    res = CliRunner().invoke(main, ["generate", *pair, *win, "--max-new-tokens", "150", "--prompt", "It was the best",
                                    "--ignore-eos", "--check-ar", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 150 and out["matches_ar"] is True  # past the 128-token context
    assert out["ar_reference"] == "ar_window24_evict4"  # (what it was compared with, for a --json reader)
    res = CliRunner().invoke(main, ["generate", *pair, "--max-new-tokens", "150", "--prompt", "It was the best",
                                    "--ignore-eos"])  # no window: stops at the context, and says how to go past it
    assert res.exit_code == 0 and "finish=context" in res.output, res.output
    assert "e.g. --option kv_window=64 --option kv_evict=16" in res.output, res.output  # (half the context)
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel
    tok = AutoTokenizer.from_pretrained(pair_dirs / "target")  # a model no window runs on: no such note
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=32)).save_pretrained(
        tmp_path / "gpt2")
    tok.save_pretrained(tmp_path / "gpt2")
    res = CliRunner().invoke(main, ["generate", "--target", str(tmp_path / "gpt2"), "--method", "ar", "--device", "cpu",
                                    "--max-new-tokens", "40", "--prompt", "It was the best", "--ignore-eos"])
    assert res.exit_code == 0 and "finish=context" in res.output and "kv_window" not in res.output, res.output
    res = CliRunner().invoke(main, ["generate", *pair, *win, "--max-new-tokens", "30", "--prompt", "It was the best",
                                    "--check-ar"])  # says which ar it compared with
    assert res.exit_code == 0 and "matches_ar=True (against ar_window24_evict4)" in res.output, res.output
    long = "It was the best of times, it was the worst of times. " * 40  # far past the context
    pq.write_table(pa.table({"text": ["It was the best of times", long]}), tmp_path / "p.parquet")
    res = CliRunner().invoke(main, ["check", *pair, "--prompts", str(tmp_path / "p.parquet"), "--methods",
                                    "dw=dynatree,lw=linear", "--option", "dw.kv_window=24", "--option", "dw.kv_evict=4",
                                    "--option", "lw.kv_window=24", "--option", "lw.kv_evict=6",
                                    "--max-new-tokens", "60", "--max-prompt-tokens", "500"])
    assert res.exit_code == 0, res.output
    table = {ln.split()[1]: ln.split()[2:4] for ln in res.output.splitlines() if "p.parquet" in ln and "/" not in ln.split()[1]}
    # each reference once per prompt, its own window's (evictions differ: different texts); windowed
    # methods keep the long prompt's 500 tokens, as a job does, so plain ar checks the short one alone
    assert table == {"ar": ["1", "ref"], **{m: ["2", "ref"] for m in ("ar_window24_evict4", "ar_window24_evict6")},
                     **{m: ["2", "2"] for m in ("dw", "lw")}}, res.output
    # generating past the context: every method windowed, so plain ar (which cannot) is left out
    res = CliRunner().invoke(main, ["check", *pair, "--prompts", str(tmp_path / "p.parquet"), "--methods", "dw=dynatree",
                                    "--option", "dw.kv_window=24", "--option", "dw.kv_evict=4", "--max-new-tokens", "150",
                                    "--max-prompt-tokens", "20"])
    assert res.exit_code == 0, res.output
    table = {ln.split()[1]: ln.split()[2:4] for ln in res.output.splitlines() if "p.parquet" in ln and "/" not in ln.split()[1]}
    assert table == {"ar_window24_evict4": ["2", "ref"], "dw": ["2", "2"]}, res.output
    res = CliRunner().invoke(main, ["check", *pair, "--prompts", str(tmp_path / "p.parquet"), "--methods",
                                    "dw=dynatree,linear", "--option", "dw.kv_window=24", "--option", "dw.kv_evict=4",
                                    "--max-new-tokens", "150"])
    assert res.exit_code != 0 and "give every one" in res.output
    res = CliRunner().invoke(main, ["check", *pair, "--prompts", str(tmp_path / "p.parquet"), "--methods", "dw=dynatree",
                                    "--option", "dw.kv_window=200", "--max-new-tokens", "8"])
    assert res.exit_code == 1 and "exceed the models' 128-token context" in res.output  # a message, no traceback
    assert "dw: kv_window 200" in res.output and "(--option dw.kv_window=N)" in res.output
    # (64 = 128 - kv_evict would not exceed kv_sinks + kv_evict: the hint says to lower both)
    assert "lower kv_evict and kv_window together" in res.output
    # a sampled ar asked for is a reference, under its own label (not merged with plain ar's rows)
    res = CliRunner().invoke(main, ["check", *pair, "--prompts", str(tmp_path / "p.parquet"), "--methods", "ar,dynatree",
                                    "--option", "temperature=0.5", "--max-new-tokens", "8", "--max-prompt-tokens", "20"])
    table = {ln.split()[1]: ln.split()[2:4] for ln in res.output.splitlines() if "p.parquet" in ln and "/" not in ln.split()[1]}
    assert table == {"ar": ["2", "ref"], "ar_t0.5": ["2", "ref"], "dynatree": ["2", "2"]}, res.output


def test_window_refusals_read_from_a_config_alone():
    """What a job's driver checks in config.json before any actor starts (names.window_refusal)."""
    from dynatree.names import window_refusal

    assert window_refusal({"model_type": "llama", "rope_parameters": {"rope_type": "llama3"}}) is None
    assert window_refusal({"model_type": "mistral", "sliding_window": 4096, "max_position_embeddings": 4096}) is None
    assert "4096-token sliding attention window" in window_refusal(
        {"model_type": "mistral", "sliding_window": 4096, "max_position_embeddings": 32768})
    assert "rope_type 'longrope'" in window_refusal({"model_type": "phi3", "rope_parameters": {"rope_type": "longrope"}})
    assert "'gpt2' is not one of them" in window_refusal({"model_type": "gpt2"})
    assert "'yarn'" in window_refusal({"model_type": "qwen2", "rope_scaling": {"type": "yarn", "factor": 4.0}})
    assert "'longrope'" in window_refusal({"model_type": "llama", "rope_parameters": {
        "full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "longrope"}}})


def test_a_draft_root_on_a_full_window_evicts_first(close_pair):
    """A commit that keeps every accepted node expanded leaves the bonus alone pending, and can
    leave the draft's cache exactly full: the next root must evict a chunk before it is fed (as
    the target does before its verification), so the root sits at the target's position inside
    the window -- fed into the full cache it would sit past the window, at another position than
    the target's."""
    from dynatree.drafting import Drafter, run
    from dynatree.tree import Tree

    win = make_window(close_pair.draft, 16, 4, 4)
    d = Drafter(close_pair.runner("draft"), close_pair.vocab, 64, window=win)
    prompt = random_prompts(1, seed=46, lo=13, hi=13)[0]
    d.extend(prompt)
    run(d, d.prefill())
    _, ids = run(d, d.root(1))
    assert d.cache.length == 13 and d.root_pos == 12
    tree, u = Tree.root_only(prompt[-1]), 0
    for _ in range(3):  # a chain, every node expanded: slots 13, 14, 15
        u = tree.add(u, ids[0], 0.0)
        ids = run(d, d.expand(tree, [u], 1))[1][0]
    d.commit([0, 1, 2, 3], tree.tokens[1:] + ids[:1])
    assert d.cache.length == 16 and d.pending == ids[:1]
    run(d, d.root(1))
    assert d.cache.length == 16 - 4 + 1 and d.root_pos == 12
