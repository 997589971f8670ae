"""Context lookup (dynatree/lookup.py): n-gram proposals, grafting onto a tree, learned gating,
and that grafted tokens are really committed while outputs stay identical to ar."""
import math

import pytest

from dynatree import decode, make_config
from dynatree.lookup import LookupStats, NgramIndex, graft
from dynatree.tree import Tree, flatten_bfs


def test_index_finds_latest_earlier_occurrence_of_longest_suffix():
    idx = NgramIndex([5, 1, 2, 7, 9, 1, 2, 3, 4, 8, 1, 2])
    # suffix (1, 2): latest earlier occurrence ends at index 6 -> followed by 3, 4, 8
    assert idx.propose(3) == ([3, 4, 8], 2)
    idx.extend([3])  # suffix (1, 2, 3) occurred at 5..7 -> 4, 8, 1, 2, 3
    assert idx.propose(5) == ([4, 8, 1, 2, 3], 3)


def test_index_prefers_the_longest_match_over_the_latest_short_one():
    # (2, 3) last occurred at 5..6 (-> 5), but (1, 2, 3) occurred at 0..2 (-> 9): longest wins
    idx = NgramIndex([1, 2, 3, 9, 7, 2, 3, 5, 1, 2, 3])
    assert idx.propose(2) == ([9, 7], 3)
    assert NgramIndex([1, 2, 3, 9, 7, 2, 3, 5, 1, 2, 3], max_n=2).propose(1) == ([5], 2)


def test_index_continues_loops_and_never_matches_itself():
    idx = NgramIndex([4, 6, 4, 6])
    # (4, 6) last ended at index 1, followed by 4, 6 -- then the copy continues from itself
    assert idx.propose(5) == ([4, 6, 4, 6, 4], 2)
    assert NgramIndex([1, 2, 3]).propose(4) == ([], 0)  # no repeated suffix
    assert NgramIndex([7]).propose(2) == ([], 0)
    assert NgramIndex([], min_n=1, max_n=1).propose(2) == ([], 0)
    assert NgramIndex([5, 7, 9, 5]).propose(2) == ([7, 9], 1)  # a one-token match (min_n) is a match too


def test_index_grown_piecewise_is_the_latest_occurrence_of_every_ngram():
    """Against the definition, brute force: random sequences over small alphabets, indexed as
    they grow by a few tokens at a time, sometimes by more (catch_up between lookups)."""
    import random
    rng = random.Random(7)
    for _ in range(300):
        vocab, lo, hi = rng.choice([2, 3, 9]), rng.randint(1, 3), rng.randint(3, 9)
        idx = NgramIndex([rng.randrange(vocab) for _ in range(rng.randint(0, 20))], lo, hi)
        for _ in range(rng.randint(1, 6)):
            idx.extend([rng.randrange(vocab) for _ in range(rng.choice([rng.randint(0, 4), rng.randint(5, 14)]))])
            idx.catch_up()
            seq, want = idx.seq, {}
            for e in range(len(seq) - 1):  # ends with a successor, in order: the latest wins
                for n in range(lo, min(hi, e + 1) + 1):
                    want[tuple(seq[e - n + 1:e + 1])] = e
            assert idx.last == want


def tree3() -> Tree:
    """root(10) -> a(11) -> b(12); root -> c(13)."""
    t = Tree.root_only(10)
    a = t.add(0, 11, math.log(0.5))
    t.add(a, 12, math.log(0.25))
    t.add(0, 13, math.log(0.3))
    return t


def test_graft_shares_existing_nodes_and_adds_the_rest():
    t = tree3()
    nodes, new = graft(t, [11, 12, 14, 15])
    assert nodes == [1, 2, 4, 5] and new == [False, False, True, True]
    assert t.parents[4:] == [2, 4] and t.depths[4:] == [3, 4] and t.tokens[4:] == [14, 15]
    assert t.grafted == {4, 5}
    flat, order = flatten_bfs(t)
    assert {order[i] for i in flat.grafted} == {4, 5}


def test_graft_diverging_at_the_root_and_keep_stays_ancestor_closed():
    t = tree3()
    t.keep = [0, 1]  # the budget verifies only a
    nodes, new = graft(t, [11, 12, 16])
    assert nodes == [1, 2, 4] and new == [False, True, True]  # b was left out: verifying it costs
    assert t.keep == [0, 1, 2, 4]
    t2 = tree3()
    nodes, _ = graft(t2, [20, 21])
    assert t2.parents[4:] == [0, 4] and nodes == [4, 5]


def test_graft_gate_stops_where_the_chain_stops_paying():
    stats = LookupStats(prior=(1.0, 1.0))  # every cell starts at 1/2
    t = tree3()
    nodes, new = graft(t, [11, 30, 31, 32], n=2, stats=stats, bar=0.2)
    # values 0.5 (shared, free), 0.25 (new: > 0.2, added), 0.125 (new: below the bar, stop)
    assert nodes == [1, 4] and new == [False, True]
    stats.observe(2, [1, 4], [False, True], path=[0, 1, 4])
    assert stats.value(2, 0, False) == 2 / 3 and stats.value(2, 1, True) == 2 / 3
    stats.observe(2, [1, 4], [False, True], path=[0, 1])
    assert stats.value(2, 1, True) == 2 / 4 and stats.value(3, 1, True) == 1 / 2  # cells are per match length


def test_lookup_commits_grafted_tokens_exactly(close_pair):
    """A prompt that repeats itself: the lookup proposes the repetition, and outputs equal ar."""
    prompt = [3, 17, 29, 41, 5, 3, 17, 29, 41, 5, 3, 17, 29]
    ref, _, _ = decode(close_pair, prompt, make_config("ar"), max_new_tokens=40, ignore_eos=True)
    for method, opts in [("linear", {"k": 1, "lookup": 8}), ("dynatree", {"hw_budget": "off", "lookup": 8}),
                         ("dynatree", {})]:
        toks, _, m = decode(close_pair, prompt, make_config(method, opts), max_new_tokens=40, ignore_eos=True)
        assert toks == ref, (method, opts)
        assert m.lookup_tokens > 0, (method, opts)
    for opts in ({"lookup": 0}, {"hw_budget": "off"}):  # off, and the default without the budget
        toks, _, m = decode(close_pair, prompt, make_config("dynatree", opts), max_new_tokens=40, ignore_eos=True)
        assert toks == ref and m.lookup_tokens == 0, opts


def test_default_lookup_follows_the_budget_and_greedy_decoding():
    assert make_config("dynatree").lookup_length == 8
    assert make_config("dynatree", {"hw_budget": "off"}).lookup_length == 0
    # sampled, copies are rarely the draw: off unless asked for (config.DynaTreeConfig.lookup_length)
    assert make_config("dynatree", {"temperature": 0.7}).lookup_length == 0
    assert make_config("dynatree", {"temperature": 0.7, "lookup": 8}).lookup_length == 8
    assert make_config("dynatree", {"hw_budget": "off", "lookup": 5}).lookup_length == 5


def test_sampled_lookup_commits_copies_and_reproduces(close_pair):
    """Sampled, a copied token is accepted where it is the target's draw; at a low temperature
    the copies are taken, and the sample is ar's with the same seed."""
    prompt = [3, 17, 29, 41, 5, 3, 17, 29, 41, 5, 3, 17, 29]
    opts = {"temperature": 0.3, "seed": 3}
    a, _, m = decode(close_pair, prompt, make_config("linear", {"k": 1, "lookup": 8, **opts}), max_new_tokens=30,
                     ignore_eos=True)
    assert a == decode(close_pair, prompt, make_config("ar", opts), max_new_tokens=30, ignore_eos=True)[0]
    assert m.lookup_tokens > 0


def test_lookup_chain_values_are_products_along_the_chain():
    """A copied chain's k-th node is accepted only if the k - 1 before it are: its value is the
    product along the chain (the budget prices deep lookup nodes with it)."""
    s = LookupStats()
    p = s.value(2, 0, True)
    assert s.values(2, 3) == pytest.approx([p, p * p, p ** 3])


def test_chain_values_learn_from_new_nodes_and_deep_positions_share_a_cell():
    """The value of a chain of new nodes comes from what new nodes at those positions earned
    (not from nodes the draft had proposed too), and positions past MAX_J pool into one cell, so
    what deep copies earned prices every deeper one."""
    s = LookupStats(prior=(1.0, 1.0))
    for _ in range(3):  # new first nodes after a 2-token match: always rejected
        s.observe(2, [5], [True], path=[0])
    s.observe(2, [1], [False], path=[0, 1])  # a shared first node: accepted
    assert s.values(2, 1) == [pytest.approx(1 / 5)]
    deep = list(range(1, 21))  # a 20-node chain of new nodes, all accepted, twice
    for _ in range(2):
        s.observe(3, deep, [True] * 20, path=[0] + deep)
    assert s.value(3, 12, True) > 0.8 and s.value(3, 25, True) == s.value(3, 12, True)


def test_graft_gate_walks_shared_nodes_freely_and_adds_a_new_one_only_above_the_bar():
    """Nodes the tree already has cost no verification, so the gate never stops on them, however
    low the chain's value there; a new node must bring more than the bar (equal is not enough)."""
    stats = LookupStats(prior=(1.0, 1.0))  # every cell 1/2: values 0.5, 0.25, 0.125 along a chain
    t = tree3()
    nodes, new = graft(t, [11, 12, 30], n=2, stats=stats, bar=0.3)
    assert nodes == [1, 2] and new == [False, False]  # b (0.25) is shared: walked; 30 (0.125) is not added
    t = tree3()
    nodes, new = graft(t, [11, 30, 31], n=2, stats=stats, bar=0.25)
    assert nodes == [1] and len(t) == 4  # 30 would bring exactly the bar: not added
