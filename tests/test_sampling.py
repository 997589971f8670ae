"""Sampling: every decoder's outputs follow the target's sampling distribution exactly.

A sample is the argmax of the target's logits perturbed by seeded Gumbel noise (sampling.py), so
every method must commit the very tokens ``ar`` draws with the same seed; and ``ar``'s draws must
follow the target.  The distribution test enumerates the exact probability of every 3-token
continuation under the target (vocabulary of 4, so 64 outcomes), draws N seeded generations and
runs a chi-square goodness-of-fit test (bins pooled to an expected count >= 5).  A decoder passes
at p >= 1e-4; the negative controls -- noise shared by every index, a verifier that accepts every
drafted token -- must fail at that threshold, so the test has the power to see a biased sampler.
"""
import itertools
from dataclasses import replace

import pytest
import torch

from dynatree import decode, make_config, pair_from_models
from dynatree import sampling
from dynatree.sampling import Sampler

from conftest import noisy_copy, random_prompts, tiny_neox

V, T, N = 4, 3, 1000
PROMPT = [1, 2, 0]
P_MIN = 1e-4


@pytest.fixture(scope="module")
def small_pair():
    target = tiny_neox(21, vocab=V, std=0.6)
    draft = noisy_copy(target, 5, 0.5)  # related but clearly different distributions
    return pair_from_models(target, draft, None, eos_token_id=None)


def exact_distribution(pair, opts, prompt=PROMPT) -> dict[tuple, float]:
    cfg = make_config("ar", {k: v for k, v in opts.items() if k in ("temperature", "top_k", "top_p")})
    s = Sampler.from_config(cfg)
    out = {}
    with torch.no_grad():
        for seq in itertools.product(range(V), repeat=T):
            ids = torch.tensor([prompt + list(seq[:-1])])
            probs = s.probs(pair.target(input_ids=ids).logits[0, -T:])  # (T, V)
            out[seq] = float(torch.prod(probs[torch.arange(T), torch.tensor(seq)]))
    return out


def chi_square_p(counts: dict, exact: dict, n: int) -> float:
    bins = sorted(exact, key=exact.get)  # pool the rarest outcomes together
    obs, exp, o, e = [], [], 0, 0.0
    for b in bins:
        o, e = o + counts.get(b, 0), e + exact[b] * n
        if e >= 5:
            obs.append(o), exp.append(e)
            o, e = 0, 0.0
    if e > 0:
        obs[-1] += o
        exp[-1] += e
    obs_t, exp_t = torch.tensor(obs, dtype=torch.float64), torch.tensor(exp, dtype=torch.float64)
    stat = ((obs_t - exp_t) ** 2 / exp_t).sum()
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def sample_counts(pair, method, opts) -> dict:
    counts: dict = {}
    for seed in range(N):
        toks, _, _ = decode(pair, PROMPT, make_config(method, {**opts, "seed": seed}),
                            max_new_tokens=T, ignore_eos=True)
        counts[tuple(toks)] = counts.get(tuple(toks), 0) + 1
    return counts


DECODERS = [
    ("linear", {"k": 3}),
    ("fixed_tree", {"depth": 2, "branch": 2, "tau": 0.2, "max_nodes": 3}),  # pruned, non-prefix subsets
    ("dynatree", {}),  # the hardware budget on: trees shaped by measured timings
    ("dynatree", {"hw_budget": "off", "lookup": 6}),  # copies grafted whole
    ("linear", {"k": 1, "lookup": 3}),
    ("dyspec", {"threshold": 0.05, "max_branch": 4}),
    ("dyspec", {"mode": "heap", "budget": 6}),
]


def test_distinct_prompts_drawn_with_one_seed_draw_independently(small_pair):
    """The noise key mixes the prompt's tokens into the seed (sampling.noise_key): two prompts
    drawn with the same seeds agree on their 3-token samples as often as independent draws would
    (sum over x of p_A(x) p_B(x): 0.052 here, 0.058 measured); with noise keyed by the seed alone
    they agreed 0.14 of the time, 9 standard errors off."""
    other, n, opts = [2, 2, 0], 600, {"temperature": 1.0}
    p_a, p_b = exact_distribution(small_pair, opts), exact_distribution(small_pair, opts, other)
    q = sum(p_a[x] * p_b[x] for x in p_a)
    same = sum(decode(small_pair, PROMPT, make_config("ar", {**opts, "seed": seed}), max_new_tokens=T,
                      ignore_eos=True)[0] == decode(small_pair, other, make_config("ar", {**opts, "seed": seed}),
                                                    max_new_tokens=T, ignore_eos=True)[0]
               for seed in range(n))
    assert abs(same / n - q) < 4 * (q * (1 - q) / n) ** 0.5, (same / n, q)
    assert Sampler(1.0, 0, 1.0, 7).key == 7 and Sampler(1.0, 0, 1.0, 7, PROMPT).key == Sampler(1.0, 0, 1.0, 7, PROMPT).key
    assert Sampler(1.0, 0, 1.0, 7, PROMPT).key != Sampler(1.0, 0, 1.0, 7, other).key
    assert sampling.noise_key(0, [1, 2, 3]) == 13041116711478803063  # fixed: a seed's samples do not move
    assert sampling._mix(7, 3) == 17879212502255054029


def test_ar_matches_target_distribution(small_pair):
    """The sampler itself: ar's seeded Gumbel-max draws follow the target."""
    opts = {"temperature": 1.0}
    p = chi_square_p(sample_counts(small_pair, "ar", opts), exact_distribution(small_pair, opts), N)
    assert p >= P_MIN, f"ar: chi-square p = {p:.2e}"


@pytest.mark.parametrize("method,opts", DECODERS, ids=[f"{m}-{o}" for m, o in DECODERS])
def test_every_method_draws_ars_sample(small_pair, method, opts):
    """Whatever the draft proposes and however the tree is shaped, a method commits the tokens
    ar draws with the same seed -- so its samples follow the target exactly (the test above)."""
    for seed in range(120):
        cfg = {"temperature": 1.0, "seed": seed}
        ref = decode(small_pair, PROMPT, make_config("ar", cfg), max_new_tokens=6, ignore_eos=True)[0]
        got, _, m = decode(small_pair, PROMPT, make_config(method, {**cfg, **opts}), max_new_tokens=6, ignore_eos=True)
        assert got == ref, (method, opts, seed)


def test_a_tree_method_matches_target_distribution(small_pair):
    opts = {"temperature": 1.0}
    p = chi_square_p(sample_counts(small_pair, "dynatree", opts), exact_distribution(small_pair, opts), N)
    assert p >= P_MIN, f"dynatree: chi-square p = {p:.2e}"


def test_context_lookup_draws_ars_sample(close_pair):
    """A prompt whose tokens repeat, so most iterations graft copied tokens: accepted or not, the
    sample is ar's."""
    prompt = [3, 17, 29, 41, 5, 3, 17, 29, 41, 5, 3, 17, 29]
    copied = 0
    for seed in range(10):
        cfg = {"temperature": 0.5, "seed": seed}
        ref = decode(close_pair, prompt, make_config("ar", cfg), max_new_tokens=30, ignore_eos=True)[0]
        for method, opts in [("linear", {"k": 1, "lookup": 8}), ("dynatree", {"lookup": 4})]:
            got, _, m = decode(close_pair, prompt, make_config(method, {**cfg, **opts}), max_new_tokens=30,
                               ignore_eos=True)
            assert got == ref, (method, seed)
            copied += m.lookup_tokens
    assert copied > 0  # copies really were committed


def test_the_same_noise_at_every_index_fails(small_pair, monkeypatch):
    """Negative control for the sampler: noise that ignores the token index gives each draw the
    right marginal but couples the tokens of a generation, and the chi-square test sees it."""
    monkeypatch.setattr(sampling, "_mix", lambda seed, j: seed)
    opts = {"temperature": 1.0}
    assert chi_square_p(sample_counts(small_pair, "ar", opts), exact_distribution(small_pair, opts), N) < P_MIN


def test_a_verifier_that_takes_every_drafted_token_fails(small_pair, monkeypatch):
    """Negative control for verification: accepting the draft's first proposal at every node
    samples the draft, which both tests catch."""
    import dynatree.engine

    def take_draft(tree, choice):
        path, u = [0], 0
        while True:
            kids = [v for v in range(1, len(tree)) if tree.parents[v] == u]
            if not kids:
                return path, choice[u]
            u = kids[0]
            path.append(u)

    monkeypatch.setattr(dynatree.engine, "accept_greedy", take_draft)
    opts = {"temperature": 1.0, "k": 3}
    assert chi_square_p(sample_counts(small_pair, "linear", opts), exact_distribution(small_pair, opts), N) < P_MIN
    ref = [decode(small_pair, PROMPT, make_config("ar", {"temperature": 1.0, "seed": s}), max_new_tokens=T)[0]
           for s in range(20)]
    got = [decode(small_pair, PROMPT, make_config("linear", {**opts, "seed": s}), max_new_tokens=T)[0]
           for s in range(20)]
    assert got != ref


def test_noise_is_gumbel_and_a_function_of_seed_and_index():
    a, b = Sampler(1.0, 0, 1.0, 7), Sampler(1.0, 0, 1.0, 7)
    g = a.noise(3, 100)
    assert torch.equal(g, b.noise(3, 100)) and torch.equal(a.noise(3, 40), g[:40])
    assert not torch.equal(g, a.noise(4, 100)) and not torch.equal(g, Sampler(1.0, 0, 1.0, 8).noise(3, 100))
    wide = Sampler(1.0, 0, 1.0, 7).noise(3, 200)
    assert torch.equal(wide[:100], g)  # a wider vocabulary extends the same noise (draft and target share it)
    big = torch.cat([a.noise(j, 5000) for j in range(20)])  # 100k draws: Gumbel mean 0.5772, variance pi^2/6
    assert abs(float(big.mean()) - 0.5772) < 0.02 and abs(float(big.var()) - 1.6449) < 0.04
    assert float(big.max()) < 23 and torch.isfinite(big).all()  # the float32 construction's bound


def test_torch_noise_is_the_c_noise(monkeypatch):
    """Machines without the C library draw the same noise (up to the logarithms' last bits)."""
    from dynatree import native
    if native.library() is None:
        pytest.skip("native kernels unavailable here")
    # the last key's index 0 hashes to 2^32 - 1: a uniform that rounds to 1 in float32 (the clamp keeps
    # its noise finite, as C's)
    keys = [0, 1, sampling._mix(7, 3), 2**64 - 1, 0x331DA08300000000]
    c = [sampling.gumbel(k, 8203) for k in keys]
    monkeypatch.setattr(native, "gumbel", lambda k0, k1, n: None)
    for k, g in zip(keys, c):
        t = sampling.gumbel(k, 8203)
        assert torch.allclose(g, t, rtol=1e-5, atol=1e-6), k


def test_warped_distribution_with_top_k_top_p(small_pair):
    opts = {"temperature": 0.6, "top_k": 3, "top_p": 0.9}
    p = chi_square_p(sample_counts(small_pair, "dynatree", opts), exact_distribution(small_pair, opts), N)
    assert p >= P_MIN, f"chi-square p = {p:.2e}"


def test_warp_by_hand():
    s = Sampler(1.0, 0, 1.0, 0)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64))
    assert torch.allclose(s.probs(logits), logits.exp())
    s.top_k = 2
    assert torch.allclose(s.probs(logits), torch.tensor([[0.625, 0.375, 0, 0]], dtype=torch.float64))
    s.top_k, s.top_p = 0, 0.75  # 0.5 + 0.3 reaches 0.75: the nucleus is the first two tokens
    assert torch.allclose(s.probs(logits), torch.tensor([[0.625, 0.375, 0, 0]], dtype=torch.float64))
    s.top_p = 0.81
    assert torch.allclose(s.probs(logits), torch.tensor([[0.5, 0.3, 0.15, 0]], dtype=torch.float64) / 0.95)
    s.top_p, s.temperature = 1.0, 0.5
    sharp = torch.tensor([[0.25, 0.09, 0.0225, 0.0025]], dtype=torch.float64)
    assert torch.allclose(s.probs(logits), sharp / sharp.sum())


@pytest.mark.parametrize("method", ["ar", "linear", "dynatree", "dyspec"])
def test_seed_reproduces_and_temperature_zero_is_greedy(close_pair, method):
    for prompt in random_prompts(3, seed=4):
        a = decode(close_pair, prompt, make_config(method, {"temperature": 0.8, "seed": 3}), max_new_tokens=20)[0]
        b = decode(close_pair, prompt, make_config(method, {"temperature": 0.8, "seed": 3}), max_new_tokens=20)[0]
        assert a == b
        greedy = decode(close_pair, prompt, make_config("ar"), max_new_tokens=20)[0]
        zero = decode(close_pair, prompt, make_config(method, {"temperature": 0.0, "seed": 9}), max_new_tokens=20)[0]
        assert zero == greedy
    seeds = {tuple(decode(close_pair, [5, 6, 7], make_config(method, {"temperature": 1.5, "seed": s}),
                          max_new_tokens=12)[0]) for s in range(5)}
    assert len(seeds) > 1  # different seeds give different samples


def test_bad_sampling_options():
    for bad in ({"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -2}):
        with pytest.raises(ValueError, match=f"got {list(bad.values())[0]}"):  # (the value given, as temperature's
            make_config("dynatree", bad)  # and seed's errors say: top_p's and top_k's did not, the sampling trial)


def test_sampling_options_at_temperature_zero_are_said_to_change_nothing(close_pair):
    """top_p=0.9 alone read as nucleus sampling to a user, and greedy decoding ran without a word."""
    from dynatree.config import unused_options, unused_options_notes
    from dynatree.engine import generate_batch

    cfg = make_config("dynatree", {"top_p": 0.9, "seed": 3})
    assert unused_options(cfg) == ("top_p=0.9, seed=3 change nothing at temperature 0 (greedy decoding); "
                                    "sampling needs a temperature above 0 (e.g. temperature=0.8)")
    assert unused_options(make_config("ar", {"top_k": 5})).startswith("top_k=5 changes nothing")
    assert unused_options(make_config("dynatree", {"top_p": 0.9, "temperature": 0.5})) is None
    assert unused_options(make_config("dynatree")) is None
    # a window's sinks or eviction without a window: a full-cache run, silently (the long-generation trial)
    assert unused_options(make_config("ar", {"kv_sinks": 8, "top_k": 2})) == (
        "top_k=2 changes nothing at temperature 0 (greedy decoding); sampling needs a temperature above 0 (e.g. "
        "temperature=0.8); kv_sinks=8 changes nothing without kv_window (no cache window: the whole cache is kept); "
        "StreamingLLM's cache needs kv_window=N")
    assert unused_options(make_config("dynatree", {"kv_window": 100, "kv_sinks": 8})) is None
    # the options of a switch turned off (the fuzzing trial: accepted without a word)
    assert unused_options(make_config("dyspec", {"mode": "heap", "threshold": 0.1})) == \
        "threshold=0.1 changes nothing in mode=heap (max_nodes best candidates)"
    assert unused_options(make_config("dynatree", {"dynamic_breadth": False, "b_max": 4, "history": False,
                                                   "hist_high": 0.8, "rho_deep": 0.5})) == (
        "b_max=4 changes nothing with dynamic_breadth=False (b_mid children everywhere); hist_high=0.8 changes "
        "nothing with history=False (no adaptation)")
    assert unused_options(make_config("dyspec", {"threshold": 0.1})) is None
    notes = unused_options_notes({"ar": make_config("ar", {"top_p": 0.9}), "dynatree": cfg,
                                   "linear": make_config("linear", {"top_p": 0.9}), "d2": make_config("dynatree")})
    assert notes == ["ar, linear: top_p=0.9 changes nothing at temperature 0 (greedy decoding); sampling needs a "
                     "temperature above 0 (e.g. temperature=0.8)", "dynatree: " + unused_options(cfg)]
    with pytest.warns(UserWarning, match="top_p=0.9, seed=3 change nothing at temperature 0"):
        generate_batch(close_pair, [[5, 6, 7]], "dynatree", {"top_p": 0.9, "seed": 3}, max_new_tokens=2)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # sampling as asked: nothing said
        generate_batch(close_pair, [[5, 6, 7]], "dynatree", {"top_p": 0.9, "temperature": 0.7}, max_new_tokens=2)


@pytest.mark.parametrize("method,opts", [("linear", {"k": 3}), ("dynatree", {"hw_budget": "auto"})])
def test_matches_target_distribution_on_the_native_kernel(method, opts):
    """The same test on a float32 pair that runs the C kernels (head width 16), budget included."""
    target = tiny_neox(21, vocab=V, std=0.6, hidden=64, dtype=torch.float32)
    draft = noisy_copy(target, 5, 0.5)
    pair = pair_from_models(target, draft, None, eos_token_id=None)
    if not pair.runner("target").native:
        pytest.skip("native kernels unavailable here")
    opts = {"temperature": 1.0, **opts}
    p = chi_square_p(sample_counts(pair, method, opts), exact_distribution(pair, opts), N)
    assert p >= P_MIN, f"{method} {opts}: chi-square p = {p:.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits_are_scored_in_float32(dtype):
    """A sampled draw is the argmax of logits / T + Gumbel noise.  Rounded to 16 bits, the noise
    ties the top scores of a 50k-token row often (bf16 ~5% of rows) and argmax then takes the
    lowest id: the draw must be the float32 scores' argmax whatever the logits' dtype."""
    from dynatree.runtime import Perturb, with_heads
    n, width = 96, 50_000
    s = Sampler(0.8, 0, 1.0, 3)
    # near-flat rows at a magnitude where 16-bit spacing is coarse (fp16: 0.0625, bf16: 0.5)
    logits = (100 + torch.randn(1, n, width, generator=torch.Generator().manual_seed(0)) * 0.01).to(dtype)
    want = (logits[0].float() / 0.8 + torch.stack([s.noise(j, width) for j in range(n)])).argmax(-1).tolist()
    out = with_heads(logits.clone(), argmax=True, perturb=Perturb(1 / 0.8, lambda w: [s.noise(j, w) for j in range(n)]))
    assert out.choice == want


def test_extreme_but_valid_settings_sample_like_ar_or_are_refused(close_pair):
    """A top_p below float32's least positive value kept no token at all (every row drew id 0, and
    speculative methods crashed): the likeliest token always stays.  A temperature so small that
    scores / temperature overflow float32 is refused, naming the least allowed."""
    x = torch.randn(3, 50)
    assert (Sampler(0.8, 0, 1e-46, 1).warp(x).isfinite().sum(-1) == 1).all()
    prompt = random_prompts(1, seed=21, lo=4, hi=4)[0]
    o = {"temperature": 0.8, "top_p": 1e-46, "seed": 3}
    greedy = decode(close_pair, prompt, make_config("ar"), max_new_tokens=6, ignore_eos=True)[0]
    for method in ("ar", "dynatree", "linear"):
        assert decode(close_pair, prompt, make_config(method, o), max_new_tokens=6, ignore_eos=True)[0] == greedy
    with pytest.raises(ValueError, match="temperature must be 0 .greedy. or at least 1e-06"):
        make_config("dynatree", {"temperature": 1e-38})


def test_a_context_shorter_than_the_budgets_profile_still_decodes():
    """The hardware budget profiles forwards of up to 64 tokens after 256 cached ones; a model with
    a 64-token context made that a negative-length prefix (a crash before the first token)."""
    target = tiny_neox(1, max_pos=64)
    pair = pair_from_models(target, noisy_copy(target, 7, 0.04), None, eos_token_id=None)
    ar = decode(pair, [5, 6, 7], make_config("ar"), max_new_tokens=8)[0]
    assert decode(pair, [5, 6, 7], make_config("dynatree"), max_new_tokens=8)[0] == ar


def test_noise_rows_cross_to_a_device_once_per_depth():
    """A sampled tree's nodes at one depth share a noise row: off the CPU it is sent once, not per
    node (the Sampler hands out a fresh view per call, which telling rows apart by object missed)."""
    from dynatree.runtime import distinct_rows
    from dynatree.sampling import Sampler

    s = Sampler(1.0, 0, 1.0, 3, [1, 2])
    rows = [s.noise(j, 50) for j in (0, 1, 1, 2, 2, 2)]
    distinct, index = distinct_rows(rows)
    assert len(distinct) == 3 and index == [0, 1, 1, 2, 2, 2]
    assert all(torch.equal(distinct[i], r) for i, r in zip(index, rows))
    assert len(distinct_rows([s.noise(0, 50), s.noise(0, 40)])[0]) == 2  # another width: another row


def test_sampled_trees_under_top_k_draw_ars_sample(close_pair):
    """Rows drawn apart from the heads (top-k / top-p) take the noise of the index each node
    predicts (base + depth): a branching tree must commit ar's sample, seed for seed.  (The
    temperature-only tests take the heads' path, not Sampler.scores: keying this path's noise by
    row index instead went unnoticed by them.)"""
    cfg_t = make_config("fixed_tree", {"depth": 3, "branch": 3, "tau": 0.0, "temperature": 0.8, "top_k": 5})
    for i, prompt in enumerate(random_prompts(6, seed=31, lo=2, hi=10)):
        opts = {"temperature": 0.8, "top_k": 5, "seed": i}
        ref = decode(close_pair, prompt, make_config("ar", opts), max_new_tokens=12, ignore_eos=True)[0]
        got, _, m = decode(close_pair, prompt, replace(cfg_t, seed=i), max_new_tokens=12, ignore_eos=True)
        assert got == ref, (prompt, got, ref)
        assert m.mean_tree_size > 3  # trees really branched


def test_proposals_stay_inside_top_k_and_each_row_gets_its_own_k():
    """A draft's proposals under top-k are the tokens it may draw: never one masked out, however
    many are asked for; packed rows asking for different k each get theirs."""
    from dynatree.sampling import propose_each

    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(3))
    s = Sampler(1.0, 2, 1.0, 5)
    vals, ids = s.propose(logits, [0, 1], 4)
    allowed = logits.topk(2, dim=-1).indices
    assert [len(r) for r in ids] == [2, 2] and all(set(r) == set(a.tolist()) for r, a in zip(ids, allowed))
    assert all(len(v) == 2 and sum(v) == pytest.approx(1.0) for v in vals)
    plain = [Sampler(1.0, 0, 1.0, 5), Sampler(1.0, 0, 1.0, 6)]
    got = propose_each(plain, [logits[:1], logits[1:]], [[0], [0]], [1, 3])
    assert [len(g[1][0]) for g in got] == [1, 3] and [len(g[0][0]) for g in got] == [1, 3]


def test_top_p_drops_a_token_the_mass_before_it_already_reaches():
    """Nucleus: a token stays while the likelier tokens before it hold less than top_p; four equal
    tokens at top_p = 0.5 keep two (the third's predecessors hold exactly 0.5)."""
    s = Sampler(1.0, 0, 0.5, 0)
    assert (s.warp(torch.zeros(1, 4)).isfinite().sum(-1) == 2).all()


def test_sample_seeds_of_nearby_seeds_do_not_collide():
    """Sample k of a prompt draws with its own seed: not the seed another run's sample 0 takes
    (jobs at seeds 3 and 4 would share draws), nor any other sample's of nearby seeds."""
    seeds = [sampling.sample_seed(s, k) for s in range(8) for k in range(8)]
    assert len(set(seeds)) == 64 and sampling.sample_seed(5, 0) == 5  # (sample 0: the plain generation)


def test_float64_logits_are_perturbed_and_drawn_in_float64():
    """A float64 model's heads perturb and read its scores in float64, as Sampler.choose does
    (warp keeps float64 logits float64), so the heads' draw is the one the top-k / top-p path would
    make: scores 1 and 1 + 1e-12 differ in float64 but tie in float32, where the draw would go
    to the lower id."""
    from dynatree.runtime import Perturb, with_heads

    logits = torch.tensor([[[1.0, 1.0 + 1e-12, 0.5], [0.25, 0.5, 0.5 + 1e-12]]], dtype=torch.float64)
    zero = Perturb(1.0, lambda width: [torch.zeros(width), torch.zeros(width)])
    assert with_heads(logits.clone(), argmax=True, perturb=zero).choice == [1, 2]


def test_distinct_rows_index_a_row_seen_again_after_another():
    """A draft level's nodes need not come depth by depth (DySpec's heap expands the nodes it
    popped, e.g. depths 2, 1, 2): a noise row met again after another is indexed at its first
    place, not at the latest distinct row's -- else that node reads another depth's noise off the
    CPU."""
    from dynatree.runtime import distinct_rows

    s = Sampler(1.0, 0, 1.0, 3, [1, 2])
    rows = [s.noise(2, 50), s.noise(1, 50), s.noise(2, 50)]
    distinct, index = distinct_rows(rows)
    assert len(distinct) == 2 and index == [0, 1, 0]
    assert all(torch.equal(distinct[i], r) for i, r in zip(index, rows))


@pytest.mark.parametrize("opts", [{"temperature": 0.8}, {"temperature": 0.8, "top_k": 20}])
def test_a_perfect_draft_proposes_the_sampled_token_first(same_pair, opts):
    """A draft identical to its target proposes each node's top-k under the noise of the index the
    node predicts -- the root's included (base + 0) -- so its first proposal is always the target's
    draw and a chain is accepted whole, through the fused heads (temperature alone) and the masked
    path (top-k).  Proposing under another index's noise stays exact (the target draws anyway) and
    so only shows in the acceptance."""
    prompt = random_prompts(1, seed=51, lo=6, hi=6)[0]
    for seed in range(3):
        cfg = make_config("linear", {"k": 4, **opts, "seed": seed})
        toks, _, m = decode(same_pair, prompt, cfg, max_new_tokens=24, ignore_eos=True)
        assert toks == decode(same_pair, prompt, make_config("ar", {**opts, "seed": seed}),
                              max_new_tokens=24, ignore_eos=True)[0]
        assert m.acceptance_rate == 1.0, (seed, m.acceptance_rate)


def test_a_wider_draft_proposes_only_shared_ids_under_top_k(target):
    """A draft scoring more ids than its target (padded widths) proposes from the shared range
    under top-k / top-p too, where proposals come from its masked scores, not the fused head's
    ``cols``: an id past the target's vocabulary in a tree would reach the target's embedding."""
    from conftest import EOS, VOCAB

    pair = pair_from_models(target, tiny_neox(5, vocab=VOCAB + 32), None, eos_token_id=EOS)
    for seed, prompt in enumerate(random_prompts(3, seed=52, lo=3, hi=10)):
        opts = {"temperature": 1.0, "top_k": 60, "seed": seed}
        ref = decode(pair, prompt, make_config("ar", opts), max_new_tokens=16, ignore_eos=True)[0]
        assert decode(pair, prompt, make_config("dynatree", opts), max_new_tokens=16, ignore_eos=True)[0] == ref
