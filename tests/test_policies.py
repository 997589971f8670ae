"""DynaTree's and DySpec's drafting rules, as the paper and the docstrings state them (the
exactness tests hold for any valid tree, so a rule broken here would change only speed)."""
import pytest

from dynatree.config import DynaTreeConfig, DySpecConfig
from dynatree.policies import DynaTree, DySpecHeap
from dynatree.tree import Tree


def _chain(depth):
    t = Tree.root_only(1)
    for d in range(depth):
        t.add(d, 2 + d, -0.1 * (d + 1))
    return t


def test_history_deepens_on_high_acceptance_and_shallows_on_low():
    cfg = DynaTreeConfig(hw_budget="off", window=4)
    up = DynaTree(cfg)
    for _ in range(cfg.window):
        up.observe(3, _chain(3), [0, 1, 2, 3])  # a_r = 1
    assert up.d0 == cfg.d0 + 1 and up.tau_h == pytest.approx(cfg.tau_h - 0.05)
    down = DynaTree(cfg)
    for _ in range(cfg.window):
        down.observe(0, _chain(3), [0])  # a_r = 0
    assert down.d0 == cfg.d0 - 1 and down.tau_h == pytest.approx(min(cfg.tau_h + 0.05, 0.99))


def test_depth_gate_needs_rho_deep_from_d0_on():
    c = DynaTreeConfig(hw_budget="off")
    p = (c.rho_stop + c.rho_deep) / 2  # above rho_stop, below rho_deep
    pol = DynaTree(c)
    assert pol._gate(c.d0 - 1, p) and not pol._gate(c.d0, p) and pol._gate(c.d0, c.rho_deep)


class _FakeDraft:
    """Root proposals (0.5, 0.3, 0.2); every node's children (0.9, 0.1)."""

    def root(self, k):
        return [0.5, 0.3, 0.2][:k], [10, 11, 12][:k]
        yield  # a generator that needs no forward

    def expand(self, tree, nodes, k):
        return [[0.9, 0.1][:k] for _ in nodes], [[20 + v, 40 + v][:k] for v in nodes]
        yield


def test_heap_adds_a_child_of_value_045_before_a_sibling_of_value_03():
    gen = DySpecHeap(DySpecConfig(mode="heap", budget=2, max_branch=3, max_depth=4)).grow(_FakeDraft(), 1, 4)
    with pytest.raises(StopIteration) as stop:
        gen.send(None)
    tree = stop.value.value
    assert tree.tokens == [1, 10, 21] and tree.parents == [-1, 0, 1]  # 0.5, then 0.5 * 0.9 = 0.45 > 0.3
