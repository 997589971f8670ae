"""Sampling: every decoder's outputs follow the target's sampling distribution exactly.

The distribution test enumerates the exact probability of every 3-token continuation under the
target (vocabulary of 4, so 64 outcomes), draws N seeded generations per decoder and runs a
chi-square goodness-of-fit test (bins pooled to an expected count >= 5).  A decoder passes at
p >= 1e-4; the negative control — a verifier that accepts every drafted token, i.e. samples
from the draft — must fail at that threshold, so the test has the power to see a biased verifier.
"""
import itertools

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


def exact_distribution(pair, opts) -> dict[tuple, float]:
    cfg = make_config("ar", {k: v for k, v in opts.items() if k in ("temperature", "top_k", "top_p")})
    s = Sampler.from_config(cfg)
    out = {}
    with torch.no_grad():
        for seq in itertools.product(range(V), repeat=T):
            ids = torch.tensor([PROMPT + list(seq[:-1])])
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
    ("ar", {}),
    ("linear", {"k": 3}),
    ("fixed_tree", {"depth": 2, "branch": 2, "tau": 0.2, "max_nodes": 3}),  # pruned, non-prefix subsets
    ("dynatree", {}),
    ("dynatree", {"lookup": 6}),  # copies tried before the draws
    ("linear", {"k": 1, "lookup": 3}),
    ("dyspec", {"threshold": 0.05, "max_branch": 4}),
    ("dyspec", {"mode": "heap", "budget": 6}),
]


@pytest.mark.parametrize("method,opts", DECODERS, ids=[f"{m}-{o}" for m, o in DECODERS])
def test_matches_target_distribution(small_pair, method, opts):
    opts = {"temperature": 1.0, **opts}
    p = chi_square_p(sample_counts(small_pair, method, opts), exact_distribution(small_pair, opts), N)
    assert p >= P_MIN, f"{method} {opts}: chi-square p = {p:.2e}"


@pytest.mark.parametrize("method,opts", [("linear", {"k": 1, "lookup": 3}), ("dynatree", {"lookup": 4})])
def test_context_lookup_keeps_the_distribution(small_pair, monkeypatch, method, opts):
    """A prompt whose tokens repeat, so most iterations try a copied token before the draft's
    draws: accepted or rejected, the samples must still follow the target."""
    import dynatree.engine
    import test_sampling
    monkeypatch.setattr(test_sampling, "PROMPT", [1, 3, 2, 1])
    tried = []
    real_walk = dynatree.engine.walk

    def spy(p, cands, children, sampler, copies=None):
        tried.append(bool(copies))
        return real_walk(p, cands, children, sampler, copies)

    monkeypatch.setattr(dynatree.engine, "walk", spy)
    opts = {"temperature": 1.0, **opts}
    p = chi_square_p(sample_counts(small_pair, method, opts), exact_distribution(small_pair, opts), N)
    assert p >= P_MIN, f"{method} {opts}: chi-square p = {p:.2e}"
    assert sum(tried) >= N // 2  # copies really were tried (in ~73% of iterations here)


def test_a_verifier_that_takes_every_copy_fails(small_pair, monkeypatch):
    """Negative control for the test above: accepting copied tokens unconditionally is caught."""
    import dynatree.engine
    import test_sampling
    monkeypatch.setattr(test_sampling, "PROMPT", [1, 3, 2, 1])
    real_walk = dynatree.engine.walk

    def take_copies(p, cands, children, sampler, copies=None):
        if copies and 0 in copies:  # take the root's copy, then sample the next token from the target
            child = children[(0, copies[0])]
            return [0, child], sampler.sample(p[child])
        return real_walk(p, cands, children, sampler, copies)

    monkeypatch.setattr(dynatree.engine, "walk", take_copies)
    opts = {"temperature": 1.0, "k": 1, "lookup": 3}
    assert chi_square_p(sample_counts(small_pair, "linear", opts), exact_distribution(small_pair, opts), N) < P_MIN


def test_warped_distribution_with_top_k_top_p(small_pair):
    opts = {"temperature": 0.6, "top_k": 3, "top_p": 0.9}
    p = chi_square_p(sample_counts(small_pair, "dynatree", opts), exact_distribution(small_pair, opts), N)
    assert p >= P_MIN, f"chi-square p = {p:.2e}"


def test_biased_verifier_fails(small_pair, monkeypatch):
    """Negative control: accepting every drafted token samples the draft, and the test sees it."""
    monkeypatch.setattr(sampling, "accept_prob", lambda r_x, q_x: 1.0)
    opts = {"temperature": 1.0, "k": 3}
    p = chi_square_p(sample_counts(small_pair, "linear", opts), exact_distribution(small_pair, opts), N)
    assert p < P_MIN, f"a biased verifier passed (p = {p:.2e})"


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
        with pytest.raises(ValueError):
            make_config("dynatree", bad)


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
