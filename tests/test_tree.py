"""Tree buffers on hand-written trees."""
import torch

from dynatree.runtime import KeyMask
from dynatree.tree import (Tree, accept_path, ancestor_matrix, flatten_bfs, position_ids,
                           tree_attention_mask)

#      0 (root, token 10)
#     / \
#    1   2      tokens 11, 12
#    |
#    3          token 13
TREE = Tree(tokens=[10, 11, 12, 13], parents=[-1, 0, 0, 1], depths=[0, 1, 1, 2], logp=[0, -.1, -2, -.3])


def test_ancestor_matrix():
    anc = ancestor_matrix(TREE.parents)
    expected = torch.tensor([[1, 0, 0, 0],
                             [1, 1, 0, 0],
                             [1, 0, 1, 0],
                             [1, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(anc, expected)


def test_mask_prefix_and_ancestors_only():
    mask = tree_attention_mask(ancestor_matrix(TREE.parents), prefix_len=2, dtype=torch.float32)
    assert mask.shape == (1, 1, 4, 6)
    allowed = (mask[0, 0] == 0).int()
    assert allowed.tolist() == [[1, 1, 1, 0, 0, 0],
                                [1, 1, 1, 1, 0, 0],
                                [1, 1, 1, 0, 1, 0],
                                [1, 1, 1, 1, 0, 1]]
    assert mask.min() == torch.finfo(torch.float32).min


def test_key_mask_compact_form():
    # the draft's form: 3 committed keys always visible, then 2 earlier tree slots and 2 new nodes
    allowed = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool)
    mask = KeyMask(3, allowed).additive(torch.float64)
    assert mask.shape == (1, 1, 2, 7)
    assert (mask[0, 0] == 0).int().tolist() == [[1, 1, 1, 1, 0, 1, 0], [1, 1, 1, 0, 1, 0, 1]]
    # and back: the leading keys every row sees become `visible` again (the first tree slot is
    # seen by row 0 only, so the visible prefix stops there)
    back = KeyMask.from_additive(mask)
    assert back.visible == 3 and torch.equal(back.allowed, allowed)
    causal = KeyMask.from_additive(KeyMask(0, torch.ones(2, 4, dtype=torch.bool).tril(2)).additive(torch.float32))
    assert causal.visible == 3 and causal.allowed.tolist() == [[False], [True]]


def test_positions_are_prefix_plus_depth():
    assert position_ids(TREE.depths, 7).tolist() == [[7, 8, 8, 9]]


def test_accept_longest_matching_path_and_bonus():
    tokens, parents = TREE.tokens, TREE.parents
    # target: after root -> 11 (node 1 ok), after node 1 -> 13 (node 3 ok), after node 3 -> 7
    path, bonus = accept_path(tokens, parents, [11, 13, 0, 7])
    assert path == [0, 1, 3] and bonus == 7
    # target prefers 12 at the root: only node 2 is correct
    path, bonus = accept_path(tokens, parents, [12, 13, 5, 7])
    assert path == [0, 2] and bonus == 5
    # nothing matches: the root alone, bonus = target's choice at the root
    path, bonus = accept_path(tokens, parents, [40, 13, 5, 7])
    assert path == [0] and bonus == 40
    # node 3 matches its parent's choice but node 1 does not match the root's: not a valid path
    path, bonus = accept_path(tokens, parents, [12, 13, 9, 7])
    assert path == [0, 2] and bonus == 9


def test_flatten_bfs_reorders_best_first_trees():
    t = Tree.root_only(10)
    a = t.add(0, 11, -0.1)   # depth 1
    b = t.add(a, 13, -0.2)   # depth 2, created before c
    c = t.add(0, 12, -1.0)   # depth 1
    flat, order = flatten_bfs(t)
    assert order == [0, a, c, b]
    assert flat.tokens == [10, 11, 12, 13]
    assert flat.parents == [-1, 0, 0, 1]
    assert flat.depths == [0, 1, 1, 2]
    same, order2 = flatten_bfs(TREE)
    assert same is TREE and order2 == [0, 1, 2, 3]


def test_best_chain_follows_the_most_probable_kept_child():
    """root -> a (p 0.5) -> c (0.3); root -> b (0.4): the chain is root, a, c -- and with a kept
    (the budget's keep) that leaves c out, root, a; ties go to the first child."""
    import math

    from dynatree.tree import best_chain

    t = Tree([10, 11, 12, 13], [-1, 0, 0, 1], [0, 1, 1, 2], [0.0, math.log(0.5), math.log(0.4), math.log(0.3)])
    assert best_chain(t) == [0, 1, 3]
    t.keep = [0, 1, 2]
    assert best_chain(t) == [0, 1]
    assert best_chain(Tree([1, 2, 3], [-1, 0, 0], [0, 1, 1], [0.0, -1.0, -1.0])) == [0, 1]
    assert best_chain(Tree.root_only(5)) == [0]


def test_max_depth_of_a_best_first_tree_is_its_deepest_node():
    """DySpec's heap grows best-first: the last node added need not be the deepest, and a tree's
    max_depth (the policies' history and the metrics read it) is the deepest node's depth."""
    t = Tree.root_only(10)
    a = t.add(0, 11, -0.1)
    t.add(a, 13, -0.2)       # depth 2
    t.add(0, 12, -1.0)       # depth 1, added last
    assert t.max_depth == 2
    assert Tree.root_only(10).max_depth == 0


def test_flatten_bfs_renumbers_lookup_nodes_and_ranks():
    """Lookup grafts its chain after drafting (lookup.graft: new nodes appended, here a depth-1
    node after a depth-2 one), so flattening reorders: the grafted set and the draft ranks must
    follow their nodes to their BFS places -- the policy's calibration skips grafted nodes and the
    metrics count tokens from lookup by these indices."""
    t = Tree.root_only(10)
    a = t.add(0, 11, -0.1, rank=0)
    t.add(a, 13, -0.2, rank=1)   # node 2, depth 2
    g = t.add(0, 14, 0.0)        # node 3, depth 1: grafted
    t.grafted.add(g)
    flat, order = flatten_bfs(t)
    assert order == [0, 1, 3, 2]
    assert flat.tokens == [10, 11, 14, 13] and flat.parents == [-1, 0, 0, 1]
    assert flat.grafted == {2}
    assert flat.ranks == [0, 0, 0, 1]


def test_flatten_bfs_of_a_kept_subset_is_in_bfs_order():
    """With ``keep`` (the budget's selection, lookup nodes added to it) the kept nodes still come
    out sorted by depth, then creation: creation order alone puts a grafted depth-1 node after a
    depth-2 one, and the module's convention (nodes sorted by depth) would no longer hold."""
    t = Tree([10, 11, 12, 13, 14], [-1, 0, 1, 0, 0], [0, 1, 2, 1, 1], [0.0, -0.1, -0.2, -0.3, 0.0])
    t.keep = [0, 1, 2, 4]        # node 3 dropped; node 4 (depth 1) was added after node 2 (depth 2)
    flat, order = flatten_bfs(t)
    assert order == [0, 1, 4, 2]
    assert flat.depths == [0, 1, 1, 2] and flat.parents == [-1, 0, 0, 1] and flat.tokens == [10, 11, 14, 12]


def test_key_mask_from_additive_counts_only_leading_visible_keys():
    """``visible`` is the run of keys every row sees *from the start*: a later key every row sees
    (here the 4th, after one row 0 alone sees) stays in ``allowed``, where it sits -- counted
    into ``visible`` it would shift every column of ``allowed`` by one."""
    allowed = torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    back = KeyMask.from_additive(KeyMask(3, allowed).additive(torch.float32))
    assert back.visible == 3 and torch.equal(back.allowed, allowed)
