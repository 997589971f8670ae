"""Tree buffers on hand-written trees."""
import torch

from dynatree.tree import Tree, accept_path, ancestor_matrix, flatten_bfs, position_ids, tree_attention_mask

#      0 (root, token 10)
#     / \
#    1   2      tokens 11, 12
#    |
#    3          token 13
TREE = Tree(tokens=[10, 11, 12, 13], parents=[-1, 0, 0, 1], depths=[0, 1, 1, 2], logp=[0, -.1, -2, -.3])


def tensors(tree=TREE):
    return (torch.tensor(tree.tokens), torch.tensor(tree.parents), torch.tensor(tree.depths))


def test_ancestor_matrix():
    _, parents, _ = tensors()
    anc = ancestor_matrix(parents, 2)
    expected = torch.tensor([[1, 0, 0, 0],
                             [1, 1, 0, 0],
                             [1, 0, 1, 0],
                             [1, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(anc, expected)


def test_mask_prefix_and_ancestors_only():
    _, parents, _ = tensors()
    mask = tree_attention_mask(ancestor_matrix(parents, 2), prefix_len=2, dtype=torch.float32)
    assert mask.shape == (1, 1, 4, 6)
    allowed = (mask[0, 0] == 0).int()
    assert allowed.tolist() == [[1, 1, 1, 0, 0, 0],
                                [1, 1, 1, 1, 0, 0],
                                [1, 1, 1, 0, 1, 0],
                                [1, 1, 1, 1, 0, 1]]
    assert mask.min() == torch.finfo(torch.float32).min


def test_positions_are_prefix_plus_depth():
    _, _, depths = tensors()
    assert position_ids(depths, 7).tolist() == [[7, 8, 8, 9]]


def test_accept_longest_matching_path_and_bonus():
    tokens, parents, depths = tensors()
    anc = ancestor_matrix(parents, 2)
    # target: after root -> 11 (node 1 ok), after node 1 -> 13 (node 3 ok), after node 3 -> 7
    path, bonus = accept_path(tokens, parents, depths, anc, torch.tensor([11, 13, 0, 7]))
    assert path.tolist() == [0, 1, 3] and int(bonus) == 7
    # target prefers 12 at the root: only node 2 is correct
    path, bonus = accept_path(tokens, parents, depths, anc, torch.tensor([12, 13, 5, 7]))
    assert path.tolist() == [0, 2] and int(bonus) == 5
    # nothing matches: the root alone, bonus = target's choice at the root
    path, bonus = accept_path(tokens, parents, depths, anc, torch.tensor([40, 13, 5, 7]))
    assert path.tolist() == [0] and int(bonus) == 40
    # node 3 matches its parent's choice but node 1 does not match the root's: not a valid path
    path, bonus = accept_path(tokens, parents, depths, anc, torch.tensor([12, 13, 9, 7]))
    assert path.tolist() == [0, 2] and int(bonus) == 9


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
