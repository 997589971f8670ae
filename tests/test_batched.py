"""The batched engine (engine.BatchDecoder): every method, many sequences per forward, each row
exactly what it gets alone -- with per-row stopping."""
import shutil
import time

import numpy as np
import pytest
import torch

from dynatree import decode, make_config
from dynatree.engine import BatchDecoder, decode_batch
from dynatree.models import pair_from_models

from conftest import EOS, random_prompts, tiny_neox


@pytest.mark.parametrize("method", ["ar", "dynatree"])
def test_batched_rows_stop_independently(close_pair, method):
    prompts = random_prompts(6, seed=12, lo=2, hi=20)
    free = [decode(close_pair, p, make_config("ar"), max_new_tokens=20, ignore_eos=True)[0] for p in prompts]
    eos = free[0][4]  # an EOS that some rows hit early and others later or never
    pair = pair_from_models(close_pair.target, close_pair.draft, None, eos_token_id=eos)
    got = decode_batch(pair, prompts, make_config(method), max_new_tokens=20)
    reasons = set()
    for p, (toks, reason, _) in zip(prompts, got):
        ref, ref_reason, _ = decode(pair, p, make_config("ar"), max_new_tokens=20)
        assert toks == ref and reason == ref_reason
        reasons.add(reason)
    assert "eos" in reasons
    # a row near the context limit stops with "context" while the others go on
    ctx = pair.max_context
    long = random_prompts(1, seed=13, lo=ctx - 5, hi=ctx - 5)[0]
    got = decode_batch(close_pair, [long, prompts[1]], make_config(method), max_new_tokens=20, ignore_eos=True)
    assert got[0][1] == "context" and len(got[0][0]) == 5
    assert got[1][0] == decode(close_pair, prompts[1], make_config("ar"), max_new_tokens=20, ignore_eos=True)[0]


# ---- the batched engine (engine.BatchDecoder): every method, many sequences per forward ----


METHODS = [("ar", {}), ("linear", {}), ("fixed_tree", {}), ("dynatree", {}), ("dynatree", {"hw_budget": "off"}),
           ("dynatree", {"lookup": 4, "hw_budget": "off"}), ("dyspec", {}), ("dyspec", {"mode": "heap", "budget": 6}),
           ("dynatree", {"kv_update": "recompute"})]


@pytest.mark.parametrize("kernel", ["lean", "hf"])
def test_batched_decoding_equals_ar_every_method_float64(close_pair, kernel):
    """Torch paths (float64; dynatree's packed forward and transformers' padded one): a batch of
    ragged prompts, each row with its own method and length budget, gives every row AR's tokens;
    a row joins after two steps."""
    if kernel == "hf":
        close_pair = pair_from_models(close_pair.target, close_pair.draft, None, eos_token_id=EOS, kernel="hf")
    prompts = random_prompts(7, seed=21, lo=1, hi=20)
    ns = [1, 5, 17, 30, 9, 30, 2]
    refs = [decode(close_pair, p, make_config("ar"), max_new_tokens=n, ignore_eos=True)[0] for p, n in zip(prompts, ns)]
    for method, opts in METHODS:
        got = decode_batch(close_pair, prompts[:3], make_config(method, opts), max_new_tokens=17, ignore_eos=True)
        assert [g[0] for g in got] == [decode(close_pair, p, make_config("ar"), max_new_tokens=17, ignore_eos=True)[0]
                                       for p in prompts[:3]], (method, opts)
    dec, got = BatchDecoder(close_pair), {}
    for i, (p, n) in enumerate(zip(prompts, ns)):
        if i == len(prompts) - 1:
            for _ in range(2):
                got.update((k, t) for k, t, _, _ in dec.step())
        method, opts = METHODS[i % len(METHODS)]
        dec.add(p, make_config(method, opts), max_new_tokens=n, ignore_eos=True, key=i)
    while dec:
        got.update((k, t) for k, t, _, _ in dec.step())
    assert [got[i] for i in range(len(prompts))] == refs


def f32_pair(eos=None):
    target, draft = tiny_neox(31, hidden=64, dtype=torch.float32), tiny_neox(32, hidden=64, layers=1, dtype=torch.float32)
    return pair_from_models(target, draft, None, eos_token_id=EOS if eos is None else eos)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
@pytest.mark.parametrize("batch", [1, 2, 5])
def test_batched_native_greedy_is_batch1_ar(batch):
    """Native kernel, float32, no tolerance: at any batch size every row's tokens (with EOS
    stops) are batch-1 AR's, and every iteration is one target forward per row."""
    pair = f32_pair()
    assert pair.runner("target").native
    prompts = random_prompts(5, seed=23, lo=2, hi=40)
    refs = [decode(pair, p, make_config("ar"), max_new_tokens=24) for p in prompts]
    for method, opts in METHODS[1:]:
        for at in range(0, len(prompts), batch):
            chunk = prompts[at:at + batch]
            for (toks, reason, m), (ref, ref_reason, _) in zip(decode_batch(pair, chunk, make_config(method, opts),
                                                                            max_new_tokens=24), refs[at:at + batch]):
                assert (toks, reason) == (ref, ref_reason), (method, opts, batch)
                if opts.get("kv_update") != "recompute":
                    assert m.target_forwards == m.iterations + 1


@pytest.mark.parametrize("kernel", ["lean", "hf"])
def test_batched_sample_does_not_depend_on_neighbours(kernel):
    """Sampling: a row's sample is a function of its prompt and seed alone -- ar's, alone or in
    a batch of any method, hardware budget included; rows under top-k / top-p (drawn apart from
    the forward's heads, all in one read) beside plain ones.  On the native kernel (float32, bitwise)
    and on transformers' padded forward (float64)."""
    if kernel == "lean" and shutil.which("cc") is None:
        pytest.skip("no C compiler on this machine")
    if kernel == "lean":
        pair = f32_pair()
    else:
        target, draft = tiny_neox(31, hidden=64), tiny_neox(32, hidden=64, layers=1)
        pair = pair_from_models(target, draft, None, eos_token_id=EOS, kernel="hf")
        assert pair.runner("target").batch_problem == ""
    prompts = random_prompts(4, seed=25, lo=3, hi=20)
    warps = [{}, {"top_k": 5}, {"top_p": 0.9}, {"top_k": 3, "top_p": 0.8}]
    cfgs = [make_config("ar", {"temperature": 0.8, "seed": 100 + i, **w}) for i, w in enumerate(warps)]
    alone = [decode(pair, p, c, max_new_tokens=20, ignore_eos=True)[0] for p, c in zip(prompts, cfgs)]
    assert len(set(map(tuple, alone))) > 1
    for method, opts in (("ar", {}), ("linear", {}), ("dynatree", {}), ("dynatree", {"hw_budget": "off"})):
        cfgs = [make_config(method, {"temperature": 0.8, "seed": 100 + i, **w, **opts}) for i, w in enumerate(warps)]
        together = decode_batch(pair, prompts, cfgs, max_new_tokens=20, ignore_eos=True)
        assert [t for t, _, _ in together] == alone, (method, opts)
        if opts:  # without the budget a row's trees are its own too: the same proposals, so the same iterations
            solo = [decode(pair, p, c, max_new_tokens=20, ignore_eos=True)[2] for p, c in zip(prompts, cfgs)]
            assert [m.iterations for _, _, m in together] == [m.iterations for m in solo]


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
def test_threads_sharing_a_pair_take_turns():
    """Two threads decoding with one pair get what each gets alone (the native forward's work
    buffer, the caches' runners and the prefix store are the pair's: ModelPair.lock)."""
    import threading

    pair = f32_pair()
    prompts = random_prompts(4, seed=27, lo=3, hi=30)
    alone = {i: decode(pair, p, make_config(m), max_new_tokens=24, ignore_eos=True)[0]
             for i, (p, m) in enumerate(zip(prompts, ("ar", "dynatree", "ar", "linear")))}
    got, errors = {}, []

    def work(ids):
        try:
            for _ in range(4):
                for i in ids:
                    m = ("ar", "dynatree", "ar", "linear")[i]
                    got.setdefault(i, []).append(decode(pair, prompts[i], make_config(m), max_new_tokens=24,
                                                        ignore_eos=True)[0])
        except Exception as e:  # (a thread's failure fails the test)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(ids,)) for ids in ((0, 1), (2, 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and all(runs == [alone[i]] * 4 for i, runs in got.items()) and len(got) == 4


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
def test_a_row_is_built_and_queued_under_the_pairs_lock(monkeypatch):
    """A service's request thread adds rows while its decode thread steps: add holds the pair's
    lock, as step does, from building the row to queueing it (building may run the budget's first
    profile on the runners a step is using -- it freed the native work buffer under it -- and a row
    queued during a step's prefill was lost), so a row added from another thread while a step runs
    waits for it, then decodes to what it gets alone."""
    import threading

    from dynatree import engine

    pair = f32_pair()
    prompt = random_prompts(1, seed=29, lo=3, hi=20)[0]
    alone = decode(pair, prompt, make_config("dynatree"), max_new_tokens=16, ignore_eos=True)[0]
    owned, built = [], engine.new_cache
    monkeypatch.setattr(engine, "new_cache", lambda *a, **k: owned.append(pair.lock._is_owned()) or built(*a, **k))
    dec, added = BatchDecoder(pair), threading.Event()
    with pair.lock:  # (as a step on another thread holds it)
        t = threading.Thread(target=lambda: (dec.add(prompt, make_config("dynatree"), max_new_tokens=16,
                                                     ignore_eos=True, key="a"), added.set()))
        t.start()
        assert not added.wait(0.5)  # the row waits for the step
    t.join(60)
    assert added.is_set() and owned == [True]  # the row (its last piece, its cache) built under the lock
    got = {}
    while dec:
        got.update((k, toks) for k, toks, _, _ in dec.step())
    assert got == {"a": alone}


def test_generate_batch_is_generate_per_prompt(close_pair):
    from dynatree import generate, generate_batch

    prompts = random_prompts(3, seed=27, lo=2, hi=12)
    gens = generate_batch(close_pair, prompts, "dynatree", {"hw_budget": "off"}, max_new_tokens=12)
    for p, g in zip(prompts, gens):
        one = generate(close_pair, p, "dynatree", {"hw_budget": "off"}, max_new_tokens=12)
        assert (g.token_ids, g.finish_reason, g.options) == (one.token_ids, one.finish_reason, one.options)


def test_the_api_names_the_callers_line_and_reads_ids_as_given(close_pair, pair_dirs):
    """Trial AG: generate's warnings named engine.py, not the caller; a tokenizer-less pair's text read
    "" (as if nothing was generated); Stop refused the numpy ids generate takes; a misspelt
    attn_implementation passed unseen on the lean kernels."""
    import warnings

    import numpy as np

    from dynatree import Stop, generate, generate_batch, load_pair
    from dynatree.models import PairError

    for call in (lambda: generate(close_pair, [5, 6], "ar", {"top_k": 5}, max_new_tokens=2),
                 lambda: generate_batch(close_pair, [[5, 6]], "ar", {"top_k": 5}, max_new_tokens=2)):
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            g = call()
        assert [w.filename for w in said if "changes nothing" in str(w.message)] == [__file__]
    g = g[0] if isinstance(g, list) else g
    assert g.text is None and len(g.token_ids) == 2  # (no tokenizer: no text, not an empty one)
    assert Stop(token_ids=(np.int64(7),)).token_ids == (7,) and type(Stop(token_ids=(np.int64(7),)).token_ids[0]) is int
    with pytest.raises(PairError, match="attn_implementation must be one of .*eager, flash_attention_2, .*got 'flash_attention2'"):
        load_pair(pair_dirs / "target", pair_dirs / "draft", attn_implementation="flash_attention2")


def test_generate_batch_samples(close_pair):
    """samples=3: three draws per prompt, a prompt's together; the first is the 1-sample generation,
    each is ar's draw with the seed its options record, and draws differ (a prompt's, and those
    of prompts given twice: each draw of a batch has its own seed)."""
    from dynatree import generate_batch

    prompts, opts = random_prompts(2, seed=28, lo=40, hi=60), {"temperature": 1.0, "seed": 3}
    gens = generate_batch(close_pair, prompts, "dynatree", opts, max_new_tokens=10, ignore_eos=True, samples=3)
    assert len(gens) == 6
    one = generate_batch(close_pair, prompts, "dynatree", opts, max_new_tokens=10, ignore_eos=True)
    assert gens[0].token_ids == one[0].token_ids and gens[0].options["seed"] == 3
    assert len({g.options["seed"] for g in gens}) == 6  # every draw its own noise, distinct prompts' too
    twice = generate_batch(close_pair, [prompts[0]] * 2, "ar", opts, max_new_tokens=10, ignore_eos=True)
    assert twice[0].token_ids == one[0].token_ids and twice[1].token_ids != twice[0].token_ids
    for i, g in enumerate(gens):
        ar = generate_batch(close_pair, [prompts[i // 3]], "ar", {**opts, "seed": g.options["seed"]},
                            max_new_tokens=10, ignore_eos=True)[0]
        assert g.token_ids == ar.token_ids
    assert len({tuple(g.token_ids) for g in gens[:3]}) > 1 or len({tuple(g.token_ids) for g in gens[3:]}) > 1
    assert sum(g.metrics.cached_prompt_tokens for g in gens) > 0  # a prompt's draws share its prefill
    for bad in ({}, {"temperature": 1.0, "top_k": 1}):
        with pytest.raises(ValueError, match="samples=2 needs sampling"):
            generate_batch(close_pair, prompts, "ar", bad, samples=2)
    with pytest.raises(ValueError, match="samples must be"):
        generate_batch(close_pair, prompts, "ar", opts, samples=0)


def test_a_bad_row_is_refused_by_add_and_the_batch_goes_on(close_pair):
    """BatchDecoder.add checks what would otherwise fail inside a shared forward (and take every
    row with it): token ids outside the vocabulary or not ints, max_new_tokens < 1, a key in use."""
    dec = BatchDecoder(close_pair)
    dec.add([3, 4, 5], make_config("dynatree"), max_new_tokens=4, key="a")
    for bad, match in (([close_pair.vocab], "outside the vocabulary"), ([-5], "outside the vocabulary"),
                       ("Hello", "list of ints"), ([True, False], "must be ints"), ([1.0], "must be ints"), ([], "empty"),
                       (torch.tensor(3), "must be ints"), (torch.tensor([[3]]), "must be ints"), (7, "must be ints")):
        with pytest.raises(ValueError, match=match):
            dec.add(bad, key="b")
    for n in (0, -3, 2.0):
        with pytest.raises(ValueError, match="max_new_tokens"):
            dec.add([3], max_new_tokens=n, key="b")
    with pytest.raises(ValueError, match="still decoding"):
        dec.add([6], key="a")
    dec.add(np.array([6, 7]), key="n")  # arrays and tensors of ints are fine
    dec.add(torch.tensor([6, 7]), key="t")
    got = {}
    while dec:
        got.update((k, toks) for k, toks, _, _ in dec.step())
    assert sorted(got) == ["a", "n", "t"] and got["n"] == got["t"] and len(got["a"]) == 4


def test_a_step_that_raised_part_way_refuses_to_go_on_and_names_its_rows(close_pair, monkeypatch):
    """An error inside a step (Ctrl-C, out of memory) leaves rows part-way through an iteration:
    the next step failed inside the drafter with "both buffer length (0) and count (-1) must not
    be 0" (the Python API trial).  It now says what happened; the rows, added to a new decoder,
    still give ar's tokens."""
    prompts = random_prompts(3, seed=9)
    ref = [decode(close_pair, p, make_config("ar"), max_new_tokens=12, ignore_eos=True)[0] for p in prompts]
    dec = BatchDecoder(close_pair)
    for i, (p, m) in enumerate(zip(prompts, ("linear", "dynatree", "ar"))):
        dec.add(p, make_config(m), max_new_tokens=12, ignore_eos=True, key=i)
    dec.step()
    dec.step()

    def boom(*a, **k):
        raise RuntimeError("out of memory (injected)")

    monkeypatch.setattr(dec.target, "forward", boom)
    with pytest.raises(RuntimeError, match="injected"):
        dec.step()
    monkeypatch.undo()
    for again in (dec.step, lambda: dec.add([3], key="x")):
        with pytest.raises(RuntimeError, match=r"step raised RuntimeError: out of memory \(injected\).*3 row\(s\) in "
                                               r"flight \(keys \[0, 1, 2\]\) to a new BatchDecoder, where they start from their prompts \(each "
                                               r"row's key, prompt and committed tokens are in this one's .partial"):
            again()
    got = decode_batch(close_pair, prompts, [make_config(m) for m in ("linear", "dynatree", "ar")], max_new_tokens=12,
                       ignore_eos=True)
    assert [g[0] for g in got] == ref
    # what each row had committed is kept (the service trial: lost), and a greedy row continued from it is ar's
    assert [(k, p) for k, p, _ in dec.partial] == list(enumerate(prompts))
    had = {k: toks for k, _, toks in dec.partial}
    assert all(0 < len(had[i]) < 12 for i in range(3))
    fresh = BatchDecoder(close_pair)
    for k, p, toks in dec.partial:
        fresh.add(p + toks, make_config("dynatree"), max_new_tokens=12 - len(toks), ignore_eos=True, key=k)
    done = {}
    while fresh:
        done.update((k, toks) for k, toks, _, _ in fresh.step())
    assert [had[i] + done[i] for i in range(3)] == ref


def test_a_cancelled_row_leaves_and_the_others_decode_on_unchanged(close_pair):
    """BatchDecoder.cancel(key): a service whose client went away stops that row (the service trial
    found no way but an exception); the row's committed tokens are ar's, the rest finish as ar's."""
    prompts = random_prompts(3, seed=5)
    ref = [decode(close_pair, p, make_config("ar"), max_new_tokens=16, ignore_eos=True)[0] for p in prompts]
    dec = BatchDecoder(close_pair)
    for i, p in enumerate(prompts):
        dec.add(p, make_config("dynatree"), max_new_tokens=16, ignore_eos=True, key=i)
    assert dec.cancel("nope") is None
    dec.step()
    dec.step()
    part = dec.cancel(1)
    assert 0 < len(part) < 16 and part == ref[1][:len(part)] and len(dec) == 2 and dec.cancel(1) is None
    with pytest.raises(ValueError, match="cancel takes the key a row was added with"):
        dec.cancel(None)
    got = {}
    while dec:
        got.update((k, toks) for k, toks, _, _ in dec.step())
    assert got == {0: ref[0], 2: ref[2]}


def test_generate_batch_takes_a_list_of_prompts(close_pair):
    from dynatree import generate_batch

    for bad in ("Hello", b"Hello", [b"Hi"], [{"role": "user", "content": "hi"}]):
        with pytest.raises(ValueError):
            generate_batch(close_pair, bad, "ar", max_new_tokens=2)
    gens = generate_batch(close_pair, (p for p in [[3, 4], [5]]), "ar", max_new_tokens=2)  # a generator is read once
    assert len(gens) == 2
    assert len(generate_batch(close_pair, [[3, 4]], "ar", {"temperature": np.float32(0.7), "seed": np.int64(1)},
                              max_new_tokens=2, samples=np.int64(2))) == 2  # numpy's numbers are numbers
    assert len(generate_batch(close_pair, [torch.tensor([3, 4]), np.array([5])], "ar",
                              max_new_tokens=np.int64(2))[1].token_ids) == 2
    for pair in ("demo", None):
        with pytest.raises(TypeError, match="pair must be a ModelPair from load_pair"):
            generate_batch(pair, ["hi"], "ar")
    for bad in ([None], [7]):
        with pytest.raises(ValueError, match="a prompt is a text, token ids or chat messages, got"):
            generate_batch(close_pair, bad, "ar", max_new_tokens=2)
    for cfg in ("dynatree", {"k": 3}):
        with pytest.raises(ValueError, match="cfg must be a method's config"):
            BatchDecoder(close_pair).add([3, 4], cfg)


def test_generate_rejects_a_whitespace_prompt_like_run(close_pair):
    from dynatree import generate
    with pytest.raises(ValueError, match="empty"):
        generate(close_pair, "  \n\t ", "ar")
    with pytest.raises(ValueError, match="max_new_tokens must be a whole number"):
        generate(close_pair, [3, 4], "ar", max_new_tokens=3.5)
    with pytest.raises(ValueError, match="options is a LinearConfig, not the config of method 'ar'"):
        generate(close_pair, [3, 4], "ar", make_config("linear"))
    with pytest.raises(ValueError, match=r"options must be a dict of the method's options .* got list"):
        generate(close_pair, [3, 4], "ar", [("k", 1)])  # (it read "options is a list, not the config of method 'ar'")
    with pytest.raises(ValueError, match="1 configs for 2 prompts"):
        decode_batch(close_pair, [[3], [4]], [make_config("ar")])


def test_a_bad_prompt_among_several_is_named(close_pair):
    """Of several prompts, the one an error is about is named by its index (it was not)."""
    from dynatree import ContextError, generate, generate_batch

    with pytest.raises(ValueError, match=r"^prompt 2 \(of 0..2\) is empty or only whitespace"):
        generate_batch(close_pair, ["a b", "c", " "], "ar")
    long = [5] * close_pair.max_context
    with pytest.raises(ContextError, match=r"^prompt 1 \(of 0..2\): prompt of \d+ tokens leaves no room"):
        generate_batch(close_pair, [[3], long, [4]], "ar")
    with pytest.raises(ContextError, match=r"^prompt 1 \(of 0..1\): prompt of"):  # two draws each: still prompt 1
        generate_batch(close_pair, [[3], long], "ar", {"temperature": 1.0}, samples=2)
    with pytest.raises(ContextError, match=r"^prompt of \d+ tokens"):  # the only prompt: no index
        generate(close_pair, long, "ar")
    with pytest.raises(ValueError, match=r"^stop token ids \[1000000\] are outside"):  # every prompt's: none named
        generate_batch(close_pair, [[3], [4]], "ar", stop_token_ids=[10**6])
    with pytest.raises(ContextError, match=r"^kv_window"):
        generate_batch(close_pair, [[3], [4]], "ar", {"kv_window": 10**6})


def _watch_prefills(monkeypatch) -> list[tuple[int, int]]:
    """Every Drafter.prefill from now on: (tokens it fed, restarts it made), in call order."""
    from dynatree.drafting import Drafter

    calls, prefill = [], Drafter.prefill

    def watched(self):
        fed, restarts = self.fed_tokens, self.restarts
        yield from prefill(self)
        calls.append((self.fed_tokens - fed, self.restarts - restarts))

    monkeypatch.setattr(Drafter, "prefill", watched)
    return calls


@pytest.mark.parametrize("opts", [{}, {"temperature": 0.9, "seed": 5}])
def test_drafts_that_sat_out_iterations_restart_and_tokens_stay_ars(close_pair, monkeypatch, opts):
    """Batched, the governor's plain iterations leave drafts behind; with draft_context a draft
    more than that many tokens behind restarts on the latest ones (drafting.Drafter.prefill).
    Every row's tokens are still ar's, greedy and sampled."""
    from dynatree.budget import Governor

    calls = iter(range(1 << 20))
    monkeypatch.setattr(Governor, "skip_drafting", lambda self, rows=0: next(calls) % 6 != 5)  # 5 plain, 1 drafted
    prefills = _watch_prefills(monkeypatch)
    prompts = random_prompts(4, seed=3, lo=2, hi=3)
    cfg = make_config("dynatree", {"draft_context": 3, **opts})
    got = decode_batch(close_pair, prompts, cfg, max_new_tokens=40, ignore_eos=True)
    refs = [decode(close_pair, p, make_config("ar", opts), max_new_tokens=40, ignore_eos=True)[0] for p in prompts]
    assert [g[0] for g in got] == refs
    restarts = [r for _, r in prefills]
    assert sum(restarts) >= 4 * 4, restarts  # every row, most of its ~6 drafted iterations


def test_a_rows_prompt_goes_through_its_draft_at_its_first_tree_and_never_without_one(close_pair, monkeypatch):
    """A batch the governor keeps on bare roots throughout never runs its drafts (not even over the
    prompts: that had cost a tree-less batched dynatree row ~1.6% of ar's time); rows that draft later
    feed the draft their prompt first, by itself (as a prefill, outside the iteration's timing),
    then catch up on what was committed meanwhile.  Tokens are ar's either way."""
    from dynatree.budget import Governor

    prompts = random_prompts(3, seed=4, lo=5, hi=9)
    refs = [decode(close_pair, p, make_config("ar"), max_new_tokens=12, ignore_eos=True)[0] for p in prompts]
    monkeypatch.setattr(Governor, "skip_drafting", lambda self, rows=0: True)
    got = decode_batch(close_pair, prompts, make_config("dynatree"), max_new_tokens=12, ignore_eos=True)
    assert [g[0] for g in got] == refs and [g[2].draft_forwards for g in got] == [0, 0, 0]
    calls = iter(range(1 << 20))
    monkeypatch.setattr(Governor, "skip_drafting", lambda self, rows=0: next(calls) < 4)  # 4 plain, then trees
    prefills = _watch_prefills(monkeypatch)
    got = decode_batch(close_pair, prompts, make_config("dynatree"), max_new_tokens=12, ignore_eos=True)
    assert [g[0] for g in got] == refs and all(g[2].draft_forwards > 0 for g in got)
    fed = [f for f, _ in prefills]
    assert fed[:6] == [len(p) for p in prompts] + [4] * 3  # each prompt, then the 4 plain iterations' tokens
    # more tokens since join than the draft reads (draft_context): it starts on the latest ones alone
    prefills.clear()
    calls = iter(range(1 << 20))
    got = decode_batch(close_pair, prompts, make_config("dynatree", {"draft_context": 3}), max_new_tokens=12,
                       ignore_eos=True)
    assert [g[0] for g in got] == refs and [f for f, _ in prefills[:3]] == [3, 3, 3]


def test_prefill_time_is_the_prefill_and_ttft_adds_the_wait_to_join(close_pair):
    dec = BatchDecoder(close_pair)
    dec.add([5, 6, 7], make_config("ar"), max_new_tokens=4, key="a")
    dec.step()
    dec.add([8, 9, 10, 11], make_config("dynatree"), max_new_tokens=4, key="b")
    time.sleep(0.05)  # waiting to join: in ttft_s, not in prefill_time_s
    done = {}
    while dec:
        done.update({key: m for key, _, _, m in dec.step()})
    m = done["b"]
    assert 0 < m.prefill_time_s and m.ttft_s >= m.prefill_time_s + 0.05


def test_a_neighbours_prefill_is_forward_time_not_overhead(close_pair, monkeypatch):
    """A row that waits through a joining row's prefill spent that time in a forward: in its
    forward_time_s, not its overhead_fraction (trial AF: 0.75 'overhead' for a row that had none)."""
    prefixes = BatchDecoder._prefixes

    def slow(self, rows, which, after=False):  # (inside the prefill's timing: a long prompt's forward)
        if which == "target" and not after and any(r.key == "j" for r in rows):
            time.sleep(0.3)
        return prefixes(self, rows, which, after)

    monkeypatch.setattr(BatchDecoder, "_prefixes", slow)
    dec = BatchDecoder(close_pair)
    dec.add([5, 6, 7], make_config("ar"), max_new_tokens=6, ignore_eos=True, key="a")
    dec.step(), dec.step()
    dec.add([8, 9, 10, 11], make_config("ar"), max_new_tokens=5, ignore_eos=True, key="j")
    time.sleep(0.05)  # (waiting to join is neither's forward)
    done = {}
    while dec:
        done.update({key: m for key, _, _, m in dec.step()})
    a, j = done["a"], done["j"]
    assert j.prefill_time_s >= 0.3 and a.forward_time_s > j.prefill_time_s  # (both finished in one step)
    assert a.forward_time_s >= j.forward_time_s and a.overhead_fraction < 0.5


def test_a_huge_max_new_tokens_allocates_the_context_not_the_request(close_pair):
    """Rows stop at the context anyway: max_new_tokens=10**9 allocated caches for 10**9 tokens
    (a memory error, or hundreds of GB reserved), now the context's."""
    toks, reason, m = decode(close_pair, [5, 6, 7], make_config("dynatree"), max_new_tokens=10**9, ignore_eos=True)
    assert reason == "context" and len(toks) == close_pair.max_context - 3 and m.kv_cache_mb < 10


def test_transformers_runner_reads_a_batchs_heads_at_once(close_pair, monkeypatch):
    """kernel hf runs a forward per sequence, and reads their heads back together: one argmax
    read per target forward at any batch size (per sequence, each was a wait on a GPU)."""
    from dynatree import native, runtime

    pair = pair_from_models(close_pair.target, close_pair.draft, None, eos_token_id=EOS, kernel="hf")
    prompts = random_prompts(3, seed=31, lo=3, hi=12)
    alone = [decode(pair, p, make_config("ar"), max_new_tokens=6, ignore_eos=True)[0] for p in prompts]
    reads, real = [], native.argmax_rows
    monkeypatch.setattr(native, "argmax_rows", lambda x: reads.append(x.shape[0]) or real(x))
    got = decode_batch(pair, prompts, make_config("ar"), max_new_tokens=6, ignore_eos=True)
    assert [t for t, _, _ in got] == alone
    assert max(reads) == 3 and len(reads) <= 7  # three rows a read: a prefill's, then 5 steps'


def test_the_budget_measures_each_iterations_overhead_once(close_pair, monkeypatch):
    """Every drafted iteration tells the budget its time outside the draft levels and the
    verification (budget.LatencyModel.observe_overhead): once per iteration for a batch's shared
    latency model, never for a Governor's plain (probe) iteration, and not at all without a
    budget."""
    from dynatree.budget import Governor, LatencyModel

    seen = []
    monkeypatch.setattr(LatencyModel, "observe_overhead", lambda self, ms: seen.append((id(self), ms)))
    prompts = random_prompts(3, seed=21, lo=3, hi=9)
    one = decode(close_pair, prompts[0], make_config("dynatree"), max_new_tokens=16, ignore_eos=True)[2]
    assert len(seen) == one.iterations and all(0 <= ms < 1e3 for _, ms in seen)
    seen.clear()
    decode_batch(close_pair, prompts, make_config("dynatree", {"hw_budget": "off"}), max_new_tokens=16, ignore_eos=True)
    assert seen == []
    calls = iter(range(1 << 20))
    monkeypatch.setattr(Governor, "skip_drafting", lambda self, rows=0: next(calls) % 2 == 0)  # every other plain
    got = decode_batch(close_pair, prompts, make_config("dynatree"), max_new_tokens=16, ignore_eos=True)
    iterations = max(m.iterations for _, _, m in got)
    assert len({k for k, _ in seen}) == 1 and iterations // 2 - 1 <= len(seen) <= iterations // 2 + 1


def test_the_governors_key_is_built_once_per_row_not_per_iteration(close_pair, monkeypatch):
    """Rows drawn with their own seeds carry their own configs; the governor is keyed by the
    config without its seed, made once per row when it joins (dataclasses.replace validates every
    field: per row per iteration it had cost 3-5% of sampled batched throughput)."""
    from dynatree import engine

    made = []
    real = engine.replace
    monkeypatch.setattr(engine, "replace", lambda cfg, **kw: made.append(kw) or real(cfg, **kw))
    cfgs = [make_config("dynatree", {"temperature": 0.8, "seed": s}) for s in (1, 2, 3)]
    got = decode_batch(close_pair, random_prompts(3, seed=8), cfgs, max_new_tokens=24, ignore_eos=True)
    assert max(m.iterations for _, _, m in got) > 6 and made == [{"seed": 0}] * 3
