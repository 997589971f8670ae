"""Every decoder reproduces greedy autoregressive decoding token for token (float64)."""
import copy

import pytest
import torch

from dynatree import decode, make_config
from dynatree.engine import decode_batch
from dynatree.models import pair_from_models

from conftest import EOS, random_prompts, tiny_neox

SETTINGS = [
    ("linear", {}),
    ("linear", {"k": 1}),
    ("linear", {"k": 8}),
    ("fixed_tree", {}),
    ("fixed_tree", {"depth": 3, "branch": 3, "tau": 0.0}),
    ("fixed_tree", {"depth": 7, "branch": 2, "tau": 0.1, "max_nodes": 10}),
    ("dynatree", {}),
    ("dynatree", {"hw_budget": "off"}),
    ("dynatree", {"hw_budget": "off", "rho_stop": 0.001, "rho_deep": 0.01, "tau": 0.0001, "window": 3}),
    ("dynatree", {"hw_budget": "off", "dynamic_breadth": False, "dynamic_depth": False, "history": False}),
    ("dynatree", {"hw_budget": "off", "max_nodes": 3}),
    ("dynatree", {"kv_update": "recompute", "hw_budget": "off"}),  # (trees each time: under load the budget
    # priced them all out of a 17-token generation, and no second forward ran: a fresh-clone CI beside three trials)
    ("dynatree", {"hw_budget": "auto", "tau": 0.001, "rho_stop": 0.002, "rho_deep": 0.05}),
    ("dynatree", {"lookup": 0}),
    ("dynatree", {"hw_budget": "off", "lookup": 4}),
    ("linear", {"k": 2, "lookup": 6}),
    ("fixed_tree", {"depth": 2, "lookup": 5, "max_nodes": 3}),
    ("dyspec", {"lookup": 3}),
    ("dyspec", {}),
    ("dyspec", {"budget": 5, "max_branch": 2}),
    ("dyspec", {"mode": "threshold"}),
    ("dyspec", {"mode": "threshold", "threshold": 0.001, "budget": 64}),
    ("dynatree", {"hw_budget": "off", "draft_context": 4}),
    ("linear", {"k": 3, "draft_context": 1}),
]
PROMPTS = random_prompts(20, seed=1)


def ar(pair, prompt, n, ignore_eos=True):
    return decode(pair, prompt, make_config("ar"), max_new_tokens=n, ignore_eos=ignore_eos)


@pytest.mark.parametrize("method,opts", SETTINGS, ids=[f"{m}-{o}" for m, o in SETTINGS])
def test_identical_to_ar(close_pair, method, opts):
    cfg = make_config(method, opts)
    for i, prompt in enumerate(PROMPTS):
        n = [1, 2, 3, 17, 40][i % 5]  # includes budgets that end mid-tree
        ref, _, _ = ar(close_pair, prompt, n)
        toks, reason, m = decode(close_pair, prompt, cfg, max_new_tokens=n, ignore_eos=True)
        assert toks == ref, (method, opts, prompt)
        assert reason == "length" and len(toks) == n
        if cfg.kv_update == "gather":
            assert m.target_forwards == m.iterations + 1
        else:  # a second forward after every iteration that verified a drafted tree
            assert m.iterations + 1 <= m.target_forwards <= 2 * m.iterations + 1
            if n >= 17:
                assert m.target_forwards > m.iterations + 1


@pytest.mark.parametrize("pair_name", ["far_pair", "same_pair"])
@pytest.mark.parametrize("method", ["linear", "fixed_tree", "dynatree", "dyspec"])
def test_identical_to_ar_other_drafts(request, pair_name, method):
    pair = request.getfixturevalue(pair_name)
    for prompt in PROMPTS[:8]:
        ref, _, _ = ar(pair, prompt, 30)
        toks, _, m = decode(pair, prompt, make_config(method), max_new_tokens=30, ignore_eos=True)
        assert toks == ref
    if pair_name == "same_pair":
        # A perfect draft must actually speculate.  Not under the hardware budget: with a draft as
        # dear as the target, whether speculating pays is a measured (noisy) close call.
        opts = {"hw_budget": "off"} if method == "dynatree" else {}
        prompt = PROMPTS[7]
        toks, _, m = decode(pair, prompt, make_config(method, opts), max_new_tokens=30, ignore_eos=True)
        assert toks == ar(pair, prompt, 30)[0]
        assert m.tokens_per_iteration > 1.5


def test_trees_speculate_on_the_close_pair(close_pair):
    for method in ["linear", "fixed_tree", "dynatree", "dyspec"]:
        _, _, m = decode(close_pair, PROMPTS[0], make_config(method), max_new_tokens=40, ignore_eos=True)
        assert m.tokens_per_iteration > 1.3, method
        assert 0 < m.acceptance_rate <= 1


def test_undefined_ratios_are_none_not_zero(close_pair):
    """A row's ratio with nothing to divide by is None (null in the output), not a 0 that reads as
    "every drafted token rejected": per-iteration ones without an iteration, per-draft ones
    without a drafted node, the time per output token with one token."""
    per_iteration = ("tokens_per_iteration", "avg_path_length", "mean_tree_size")
    per_draft = ("acceptance_rate", "accepted_per_node")
    _, _, one = decode(close_pair, PROMPTS[0], make_config("dynatree"), max_new_tokens=1, ignore_eos=True)
    assert one.iterations == 0 and one.new_tokens == 1
    assert all(getattr(one, k) is None for k in per_iteration + per_draft + ("tpot_s",))
    _, _, plain = decode(close_pair, PROMPTS[0], make_config("ar"), max_new_tokens=8, ignore_eos=True)
    assert (plain.tokens_per_iteration, plain.avg_path_length, plain.mean_tree_size) == (1.0, 0.0, 0.0)
    assert all(getattr(plain, k) is None for k in per_draft) and plain.tpot_s > 0
    _, _, tree = decode(close_pair, PROMPTS[0], make_config("linear"), max_new_tokens=8, ignore_eos=True)
    assert all(getattr(tree, k) is not None for k in per_iteration + per_draft)


def test_draft_is_never_reprefilled(close_pair):
    prompt = PROMPTS[3]
    for method in ["linear", "dynatree", "dyspec"]:
        toks, _, m = decode(close_pair, prompt, make_config(method), max_new_tokens=40, ignore_eos=True)
    # fed tokens <= prompt + commits + expanded tree nodes, far below (prompt x iterations)
    from dynatree.drafting import Drafter
    seen = []
    orig = Drafter.commit

    def spy(self, path, committed):
        seen.append(self.fed_tokens)
        return orig(self, path, committed)

    Drafter.commit = spy
    try:
        _, _, m = decode(close_pair, prompt, make_config("linear", {"k": 4}), max_new_tokens=40, ignore_eos=True)
    finally:
        Drafter.commit = orig
    # per iteration: pending (<= k+1 tokens) + k-1 chain expansions
    assert seen[-1] <= len(prompt) + m.iterations * (4 + 1 + 3)
    assert seen[-1] < len(prompt) * m.iterations or len(prompt) < 8


def test_a_perfect_draft_has_every_token_accepted_from_the_first_tree(same_pair):
    """The draft's cache holds every committed token, the first generated one included: with the
    target itself as the draft, every drafted token is accepted, at B = 1 and batched.  (Until
    2026-11-24 the drafter was fed the prompt without the first token, so the first tree proposed
    for the wrong position and the draft's context lacked that token for the whole generation.)"""
    prompts = PROMPTS[:3]
    for k in (1, 4):  # a chain, so every drafted token is on the path when the draft is right
        for batch in (prompts[:1], prompts):
            for toks, _, m in decode_batch(same_pair, batch, make_config("linear", {"k": k}), max_new_tokens=24,
                                           ignore_eos=True):
                assert m.acceptance_rate == 1.0, (k, len(batch), m.acceptance_rate)
                assert m.tokens_per_iteration > 1.9, k


def test_a_perfect_windowed_draft_keeps_its_targets_cache(same_pair):
    """With a cache window the draft holds what the target holds: a prompt longer than the window
    goes in the target's pieces (sinks kept), and tokens the target cached before an eviction are
    cached before it by the draft too (their upper layers saw the chunk that leaves).  So a
    perfect draft is still always right (it was right 24-48% of the time with long prompts)."""
    window = {"kv_window": 32, "kv_sinks": 4, "kv_evict": 4}
    for lo, hi in ((5, 20), (40, 60)):
        prompts = random_prompts(3, seed=5, lo=lo, hi=hi)
        cfg = make_config("linear", {"k": 4, **window})
        for toks, _, m in decode_batch(same_pair, prompts, cfg, max_new_tokens=60, ignore_eos=True):
            assert m.acceptance_rate == 1.0, (lo, m.acceptance_rate)


def eos_pair(base_pair, eos):
    return pair_from_models(base_pair.target, base_pair.draft, None, eos_token_id=eos)


def test_eos_inside_an_accepted_path(same_pair):
    """With a perfect draft, EOS lands inside accepted paths; decoding stops right after it."""
    hits = 0
    for prompt in PROMPTS:
        free, _, _ = ar(same_pair, prompt, 30)
        eos = free[7]  # a token that will be generated mid-way
        pair = eos_pair(same_pair, eos)
        ref, ref_reason, _ = ar(pair, prompt, 30, ignore_eos=False)
        assert ref_reason == "eos" and ref[-1] == eos
        for method in ["linear", "fixed_tree", "dynatree", "dyspec"]:
            toks, reason, m = decode(pair, prompt, make_config(method), max_new_tokens=30)
            assert toks == ref and reason == "eos", method
            hits += m.tokens_per_iteration > 1
    assert hits > 0


def test_every_eos_id_of_the_generation_config_ends_a_generation(same_pair):
    """As transformers' generate stops: an instruct model's end of turn is often listed only in
    generation_config.json's eos_token_id, beside the config's end of text."""
    target = copy.deepcopy(same_pair.target)
    free, _, _ = ar(same_pair, PROMPTS[1], 30)
    target.generation_config.eos_token_id = [EOS, free[7]]
    pair = pair_from_models(target, same_pair.draft, None)
    assert pair.eos_token_ids == (EOS, free[7]) and pair.eos_token_id == EOS
    end = next(i for i, t in enumerate(free) if t in (EOS, free[7])) + 1
    for method in ["ar", "linear", "dynatree"]:
        toks, reason, _ = decode(pair, PROMPTS[1], make_config(method), max_new_tokens=30)
        assert toks == free[:end] and reason == "eos", method
    with torch.no_grad():
        hf = target.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=30, do_sample=False, pad_token_id=EOS)
    assert hf[0, len(PROMPTS[1]):].tolist() == free[:end]


def test_context_limit(close_pair):
    ctx = close_pair.max_context
    prompt = random_prompts(1, seed=4, lo=ctx - 10, hi=ctx - 10)[0]
    ref, reason, _ = ar(close_pair, prompt, 40)
    assert reason == "context" and len(prompt) + len(ref) == ctx
    for method in ["linear", "fixed_tree", "dynatree", "dyspec"]:
        toks, reason, _ = decode(close_pair, prompt, make_config(method), max_new_tokens=40, ignore_eos=True)
        assert toks == ref and reason == "context"
    from dynatree import ContextError
    with pytest.raises(ContextError):
        decode(close_pair, [5] * ctx, make_config("dynatree"), max_new_tokens=4)


def test_ar_equals_transformers_generate(target):
    pair = pair_from_models(target, None, None, eos_token_id=EOS)
    for prompt in PROMPTS[:10]:
        ours, _, _ = ar(pair, prompt, 25, ignore_eos=False)
        with torch.no_grad():
            hf = target.generate(torch.tensor([prompt]), max_new_tokens=25, do_sample=False,
                                 eos_token_id=EOS, pad_token_id=EOS)
        assert ours == hf[0, len(prompt):].tolist()


def test_vocab_width_mismatch_is_compared_over_shared_range(target):
    """Pythia pads logit widths differently per size: the draft may score extra ids."""
    wide = tiny_neox(5, vocab=target.config.vocab_size + 32)
    pair = pair_from_models(target, wide, None, eos_token_id=EOS)
    assert pair.vocab == target.config.vocab_size
    for prompt in PROMPTS[:5]:
        ref, _, _ = ar(pair, prompt, 20)
        toks, _, _ = decode(pair, prompt, make_config("dynatree"), max_new_tokens=20, ignore_eos=True)
        assert toks == ref


def test_eos_on_the_last_allowed_token_is_an_eos_finish(same_pair):
    """EOS as the last token max_new_tokens allows ends the row with reason "eos", not "length"
    (the tokens are the same either way, so the equal-to-ar tests cannot tell)."""
    prompt = [5, 9, 11, 40, 2]
    free = decode(same_pair, prompt, make_config("ar"), max_new_tokens=30, ignore_eos=True)[0]
    k = next(k for k in range(3, 30) if free[k] not in free[:k])  # its first occurrence
    pair = pair_from_models(same_pair.target, same_pair.draft, None, eos_token_id=free[k])
    for method in ("ar", "linear", "dynatree"):
        toks, reason, _ = decode(pair, prompt, make_config(method), max_new_tokens=k + 1)
        assert toks == free[:k + 1] and reason == "eos", (method, reason)


def test_no_node_is_drafted_past_the_last_token(same_pair):
    """With one token left after the prefill, the iteration's tree is the bare root (its bonus is
    that token): drafting more is verification work whose tokens are cut."""
    for method, opts in (("linear", {"k": 4}), ("fixed_tree", {}), ("dynatree", {"hw_budget": "off"})):
        _, _, m = decode(same_pair, [5, 9, 11], make_config(method, opts), max_new_tokens=2, ignore_eos=True)
        assert m.iterations == 1 and m.mean_tree_size == 0, (method, m.mean_tree_size)
