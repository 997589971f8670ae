"""Tree verification and tree drafting compute exactly what a sequential forward computes (float64)."""
import torch

from dynatree.drafting import Drafter
from dynatree.engine import verify_seq
from dynatree.models import HFRunner
from dynatree.kvcache import new_cache
from dynatree.policies import DynaTree, DySpecHeap
from dynatree.config import DynaTreeConfig, DySpecConfig
from dynatree.tree import Tree, flatten_bfs

from conftest import hf_cache, random_prompts


def path_tokens(tree: Tree, u: int) -> list[int]:
    out = []
    while u >= 0:
        out.append(tree.tokens[u])
        u = tree.parents[u]
    return out[::-1]


def sequential_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1]


def hand_tree(root: int) -> Tree:
    t = Tree.root_only(root)
    a = t.add(0, 5, -0.1)
    b = t.add(0, 9, -0.5)
    t.add(0, 17, -0.9)
    c = t.add(a, 6, -0.2)
    t.add(a, 7, -0.3)
    t.add(b, 30, -0.6)
    t.add(c, 40, -0.3)
    return t


def test_tree_logits_equal_sequential_path_logits(target):
    for prompt in random_prompts(5, seed=3, lo=2, hi=20):
        *prefix, root = prompt
        cache = new_cache(target, 64)
        with torch.no_grad():
            if prefix:
                target(input_ids=torch.tensor([prefix]), **hf_cache(target, cache), use_cache=True)
            tree = hand_tree(root)
            out = HFRunner(target).forward([verify_seq(tree, len(prefix), cache, target.device)], argmax=True)[0]
            logits = out.logits[0]
        for u in range(len(tree)):
            ref = sequential_logits(target, prefix + path_tokens(tree, u))
            torch.testing.assert_close(logits[u], ref, rtol=0, atol=1e-10)
            assert out.choice[u] == int(ref.argmax())


class Recorder(Drafter):
    """Records the draft's top-k for every expanded node, to compare with sequential forwards."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.seen = {}

    def root(self, k):  # generators, as Drafter's are
        out = yield from super().root(k)
        self.seen[0] = out
        return out

    def expand(self, tree, nodes, k):
        probs, ids = yield from super().expand(tree, nodes, k)
        for u, p, i in zip(nodes, probs, ids):
            self.seen[u] = (p, i)
        return probs, ids


def check_draft_tree(pair, policy, prompt):
    d = Recorder(pair.runner("draft"), pair.vocab, 256)
    d.extend(prompt)
    tree = policy.draft(d, prompt[-1], 6)
    prefix = prompt[:-1]
    assert len(d.seen) > 1
    for u, (p, ids) in d.seen.items():
        ref = torch.softmax(sequential_logits(pair.draft, prefix + path_tokens(tree, u)).float(), -1)
        rv, ri = ref.topk(len(p))
        assert ri.tolist() == ids
        torch.testing.assert_close(torch.tensor(p), rv, rtol=0, atol=1e-6)
    return tree


def test_level_wise_draft_expansion_matches_sequential(close_pair):
    cfg = DynaTreeConfig(tau=1e-4, rho_stop=1e-3, rho_deep=0.01, max_nodes=40)
    for prompt in random_prompts(4, seed=5, lo=1, hi=12):
        tree = check_draft_tree(close_pair, DynaTree(cfg), prompt)
        assert tree.max_depth >= 2 and len(tree) > tree.max_depth + 1  # branched, multi-level


def test_heap_draft_expansion_matches_sequential(close_pair):
    for prompt in random_prompts(3, seed=6, lo=1, hi=12):
        tree = check_draft_tree(close_pair, DySpecHeap(DySpecConfig(budget=20)), prompt)
        assert len(tree) == 21
        flat, order = flatten_bfs(tree)
        assert all(flat.parents[i] < i for i in range(1, len(flat)))


def test_draft_commit_keeps_accepted_nodes_and_feeds_the_rest(close_pair):
    """After a commit the draft cache equals a fresh prefill of the committed tokens."""
    prompt = random_prompts(1, seed=9, lo=6, hi=6)[0]
    d = Drafter(close_pair.runner("draft"), close_pair.vocab, 256)
    d.extend(prompt)
    tree = DynaTree(DynaTreeConfig(tau=1e-4, rho_stop=1e-3, rho_deep=0.01, max_nodes=30)).draft(d, prompt[-1], 5)
    # accept the path to the deepest node, then a bonus token
    u = max(range(len(tree)), key=lambda i: tree.depths[i])
    path = []
    while u >= 0:
        path.append(u)
        u = tree.parents[u]
    path = path[::-1]
    committed = [tree.tokens[v] for v in path[1:]] + [42]
    d.commit(path, committed)
    full = prompt + committed
    n_cached = d.cache.length
    assert full[n_cached:] == d.pending and d.pending[-1] == 42
    ref = new_cache(close_pair.draft, 64)
    with torch.no_grad():
        close_pair.draft(input_ids=torch.tensor([full[:n_cached]]), **hf_cache(close_pair.draft, ref), use_cache=True)
    for a, b in zip(d.cache.layers, ref.layers):
        torch.testing.assert_close(a.keys[:, :, :n_cached], b.keys[:, :, :n_cached], rtol=0, atol=1e-10)
        torch.testing.assert_close(a.values[:, :, :n_cached], b.values[:, :, :n_cached], rtol=0, atol=1e-10)


def test_a_draft_restarts_on_its_last_tokens_when_catching_up_would_cost_more(close_pair):
    """draft_context: at join the draft reads the prompt's last tokens only (positions from 0),
    and a draft that fell further behind than that restarts on the latest ones; a shorter gap is
    caught up on as before.  The cache then equals a fresh prefill of those tokens."""
    from dynatree.drafting import run

    prompt = random_prompts(1, seed=9, lo=30, hi=30)[0]
    d = Drafter(close_pair.runner("draft"), close_pair.vocab, 256, context=8)

    def assert_cache_is_a_prefill_of(ids):
        ref = new_cache(close_pair.draft, 64)
        with torch.no_grad():
            close_pair.draft(input_ids=torch.tensor([ids]), **hf_cache(close_pair.draft, ref), use_cache=True)
        assert d.cache.length == len(ids)
        for a, b in zip(d.cache.layers, ref.layers):
            torch.testing.assert_close(a.keys[:, :, :len(ids)], b.keys[:, :, :len(ids)], rtol=0, atol=1e-10)

    d.extend(prompt)
    run(d, d.prefill())
    assert d.pending == prompt[-1:] and d.restarts == 1
    assert_cache_is_a_prefill_of(prompt[-9:-1])
    d.extend(prompt[:5])  # a gap of 5 <= 8: caught up on
    run(d, d.prefill())
    assert d.restarts == 1
    assert_cache_is_a_prefill_of(prompt[-9:] + prompt[:4])
    d.extend(prompt[:20])  # 20 tokens to catch up on > 8: restarts
    run(d, d.prefill())
    assert d.restarts == 2
    assert_cache_is_a_prefill_of((prompt[4:5] + prompt[:20])[-9:-1])


def test_a_sliding_window_hides_the_keys_an_ar_step_would_not_see():
    """KeyMask.beyond_window by hand on a 3-node chain root(4) -> a(5) -> b(6) after a 4-token
    prefix: a window of w keys shows each row the keys at its position - w + 1 .. its position."""
    from dynatree.runtime import KeyMask
    from dynatree.tree import ancestor_matrix

    mask = KeyMask(4, ancestor_matrix([-1, 0, 1]))
    pos = torch.tensor([4, 5, 6])
    T, F = True, False
    assert mask.beyond_window(pos, 3).tolist() == [[T, T, F, F, F, F, F],  # root sees 2, 3, itself
                                                   [T, T, T, F, F, F, F],  # a sees 3, root, itself
                                                   [T, T, T, T, F, F, F]]  # b sees root, a, itself
    assert mask.beyond_window(pos, 2).tolist()[2] == [T, T, T, T, T, F, F]  # b: a and itself


def test_crop_forgets_the_last_tokens_as_transformers_expects(target):
    """Cache.crop(-n) (transformers 5.x: a negative count) forgets the last n tokens: fed again,
    they give the logits of the uncut forward."""
    ids = torch.tensor([random_prompts(1, seed=12, lo=12, hi=12)[0]])
    cache = new_cache(target, 32)
    with torch.no_grad():
        full = target(input_ids=ids, **hf_cache(target, cache)).logits[0, -1]
        cache.crop(-3)
        assert cache.get_seq_length() == 9
        again = target(input_ids=ids[:, 9:], **hf_cache(target, cache)).logits[0, -1]
    assert cache.get_seq_length() == 12 and torch.allclose(again, full, rtol=0, atol=1e-10)


def test_the_draft_refuses_ids_it_cannot_embed_the_bonus_included(close_pair):
    """A target wider than its draft may choose an id the draft has no embedding for: queued
    tokens and a commit's bonus (its last token; the drafted ones came from the draft) are checked
    against the draft's vocabulary, the last id inside it (vocab - 1) allowed, ``vocab`` itself not
    (an embedding lookup past the table: on a GPU a device-side assert ends the process)."""
    import pytest

    from dynatree.drafting import DraftVocabError

    d = Drafter(close_pair.runner("draft"), 10, 64)
    d.extend([3, 9])
    with pytest.raises(DraftVocabError, match="token id 10 is outside the draft's vocabulary"):
        d.extend([4, 10])
    assert d.pending == [3, 9]
    d.commit([0, 1], [5, 9])  # (before the first tree: queued)
    with pytest.raises(DraftVocabError):
        d.commit([0, 1], [5, 10])  # a drafted 5, then the target's bonus 10


def test_a_draft_restarts_only_when_the_gap_exceeds_its_context(close_pair):
    """draft_context: a gap of exactly ``context`` tokens is caught up on (a restart would feed as
    many and drop the cached ones), one more restarts; and with no context (0) a draft never
    restarts, however far behind it fell."""
    from dynatree.drafting import run

    prompt = random_prompts(1, seed=9, lo=40, hi=40)[0]
    d = Drafter(close_pair.runner("draft"), close_pair.vocab, 256, context=8)
    d.extend(prompt[:9])  # 8 tokens before the root
    run(d, d.prefill())
    assert d.restarts == 0 and d.cache.length == 8
    d.extend(prompt[9:17])  # the old root and 7 more: 8 to feed
    run(d, d.prefill())
    assert d.restarts == 0 and d.cache.length == 16 and d.pending == prompt[16:17]
    d.extend(prompt[17:26])  # 9 to feed
    run(d, d.prefill())
    assert d.restarts == 1 and d.cache.length == 8 and d.pending == prompt[25:26]

    d = Drafter(close_pair.runner("draft"), close_pair.vocab, 256)
    d.extend(prompt[:20])
    run(d, d.prefill())
    d.extend(prompt[20:])
    run(d, d.prefill())
    assert d.restarts == 0 and d.cache.length == 39 and d.pending == prompt[39:]
