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


class _Drafter:
    """Every node's top-k: tokens 1, 2, 3 with draft probabilities 0.6, 0.2, 0.1; ``tick``
    seconds of drafting per forward (drafting.Drafter.seconds)."""

    def __init__(self, tick=0.0):
        self.seconds, self.tick = 0.0, tick

    def root(self, k):
        self.seconds += self.tick
        return [0.6, 0.2, 0.1][:k], [1, 2, 3][:k]
        yield  # a generator that needs no forward

    def expand(self, tree, nodes, k):
        self.seconds += self.tick
        return [[0.6, 0.2, 0.1][:k]] * len(nodes), [[1, 2, 3][:k]] * len(nodes)
        yield


def _budgeted(lat, calib=None, tick=0.0, **kw):
    from dynatree.budget import Calibration
    from dynatree.drafting import run
    from dynatree.policies import grow_budgeted

    args = dict(max_depth=1, max_nodes=64, kmax=2, n_children=lambda u, c: 2, gate=lambda d, v: True, tau=0.0)
    args.update(kw)
    return run(None, grow_budgeted(_Drafter(tick), 7, lat=lat, calib=calib or Calibration(), **args))


def _free():
    """Verification and drafting that cost nothing extra per token: only the rules limit a tree."""
    from dynatree.budget import LatencyModel
    return LatencyModel({1: 1.0, 64: 1.0}, {1: 0.0, 64: 0.0}, overhead_ms=0.0)


def _calibrated():
    """First choices at q = 0.6 always right (1.0); second choices at q = 0.2 right 4 in 8 (0.52)."""
    from dynatree.budget import Calibration
    cal = Calibration()
    for i in range(8):
        cal.update(0.6, True, rank=0)
        cal.update(0.2, i % 2 == 0, rank=1)
    assert cal(0.6) == 1.0 and cal(0.2, 1) == pytest.approx(0.52) and cal(0.2, 0) == 1.0
    return cal


def test_budgeted_growth_prices_nodes_with_the_calibration_of_their_rank():
    """A node's value is its parent's times the calibrated acceptance of its (q, sibling rank),
    not its raw q nor its rank-0 cell's; breadth is asked with the calibrated confidence of the
    top-1 child; nodes valued at least tau (not only above it) are drafted."""
    seen = []
    tree = _budgeted(_free(), _calibrated(), tau=0.6, n_children=lambda u, c: seen.append(c) or 2)
    assert tree.tokens == [7, 1] and seen == [1.0]  # the 0.2 second choice is worth 0.52 < tau
    assert _budgeted(_free(), _calibrated(), tau=0.5).tokens == [7, 1, 2]
    assert _budgeted(_free(), _calibrated(), tau=1.0).tokens == [7, 1]  # 1.0 >= tau: kept


def test_budgeted_growth_holds_each_node_in_its_own_cell():
    """Drafted nodes are held in their (rank, q-bin) cell until verified (Calibration.hold)."""
    from dynatree.budget import Calibration

    cal, held = Calibration(), []
    _budgeted(_free(), cal, held=held)
    assert held == [(0, 12), (1, 4)] and cal.held[1][4] == 1


def test_budgeted_growth_keeps_ancestors_first_and_sets_the_bar():
    """Nodes of equal value are ranked shallower first, so a kept node's parent is kept too (the
    verified tree must be connected); ``keep`` holds exactly the k nodes select chose, and
    ``bar`` is rate x delta of the last selection."""
    from dynatree.budget import LatencyModel

    # flat to 2 tokens, 2 ms from 3 on: verifying 1 node runs at 2 tokens/ms, 2 nodes at 1.5
    lat = LatencyModel({1: 1.0, 2: 1.0, 3: 2.0, 64: 2.0}, {1: 0.0, 64: 0.0}, overhead_ms=0.0)
    tree = _budgeted(lat, kmax=1, n_children=lambda u, c: 1, max_depth=2)  # a chain 7 -> 1 -> 1, both valued 1.0
    assert tree.tokens == [7, 1, 1] and tree.parents == [-1, 0, 1]
    assert tree.keep == [0, 1]  # the depth-1 node, not its child alone
    assert tree.bar == pytest.approx(2.0 * (2.0 - 1.0) / 4)  # rate 2 / ms, delta (verify(6) - verify(2)) / 4


def test_budgeted_growth_with_a_hint_keeps_the_drafted_nodes_above_the_cut():
    """With lookup nodes to come (hint), select chooses over both kinds; a drafted node is kept
    iff it is worth at least the last chosen value, not the first rejected one."""
    from dynatree.budget import LatencyModel

    # verification flat to 3 tokens, then 10 ms: two of the three priced nodes are chosen
    lat = LatencyModel({1: 1.0, 3: 1.0, 4: 10.0, 64: 10.0}, {1: 0.0, 64: 0.0}, overhead_ms=0.0)
    tree = _budgeted(lat, _calibrated(), hint=[0.8])  # drafted values 1.0 and 0.52
    assert tree.tokens == [7, 1, 2] and tree.keep == [0, 1]


def test_budgeted_growth_charges_the_drafting_time_spent():
    """The rate that sets the bar pays the draft forwards already run (here 20 ms), per row."""
    from dynatree.budget import LatencyModel

    lat = LatencyModel({1: 10.0, 64: 73.0}, {1: 0.0, 64: 0.0}, overhead_ms=0.0)
    tree = _budgeted(lat, kmax=1, n_children=lambda u, c: 1, tick=0.02)
    assert tree.bar == pytest.approx(2.0 / 31.0)  # 2 tokens in 20 + 11 ms, x 1 ms per token


def test_budgeted_growth_gates_the_frontier():
    """A node expands only if the depth gate passes, its best child could clear the bar
    (value x calibrated top-1 acceptance > bar), and another level pays (worth_drafting)."""
    from dynatree.budget import Calibration, LatencyModel

    chain = dict(kmax=1, n_children=lambda u, c: 1, max_depth=2)
    assert len(_budgeted(_free(), **chain)) == 3
    assert len(_budgeted(_free(), gate=lambda d, v: d < 1, **chain)) == 2  # gated at depth 1
    dear = LatencyModel({1: 1.0, 64: 1.0}, {1: 100.0, 64: 100.0}, overhead_ms=0.0)
    assert len(_budgeted(dear, **chain)) == 2  # a 100 ms draft level never pays
    cal = Calibration()  # first children right at q = 0.6 (0.82) but rarely overall (top1 0.1)
    for _ in range(8):
        cal.update(0.6, True, rank=0)
    for _ in range(90):
        cal.update(0.2, False, rank=0)
    assert cal(0.6) == pytest.approx(0.82) and cal.top1() == pytest.approx(0.1)
    # bar = 1.82 tokens/ms x (verify(6) - verify(2)) / 4 = 0.455: 0.82 x 0.1 does not clear it
    lat = LatencyModel({1: 1.0, 3: 1.0, 6: 2.0, 64: 2.0}, {1: 0.0, 64: 0.0}, overhead_ms=0.0)
    tree = _budgeted(lat, cal, **chain)
    assert len(tree) == 2 and tree.bar == pytest.approx(0.455)


def test_budgeted_growth_relaxes_once_and_times_each_level_at_its_width():
    """Each growth relaxes the draft correction once, and each draft level's time is observed at
    its frontier width (a wider level is dearer), to max_depth and no deeper."""
    from dynatree.budget import LatencyModel

    class Spy(LatencyModel):
        def __post_init__(self):
            super().__post_init__()
            self.calls = []

        def observe_draft(self, width, ms):
            self.calls.append(width)

        def relax(self):
            self.calls.append("relax")

    lat = Spy({1: 1.0, 64: 1.0}, {1: 0.0, 64: 0.0}, overhead_ms=0.0)
    tree = _budgeted(lat, max_depth=3)
    assert lat.calls == ["relax", 1, 2, 4] and max(tree.depths) == 3 and len(tree) == 1 + 2 + 4 + 8


def test_best_keeps_the_winners_in_draft_rank_order():
    """When the node budget binds, the most probable candidates win but stay in parent/rank
    order: DynaTree.observe reads a node's sibling rank from its position among its siblings."""
    from dynatree.policies import _best

    assert _best([(0.3, "a"), (0.1, "b"), (0.5, "c")], 2) == [(0.3, "a"), (0.5, "c")]


def test_breadth_follows_the_confidence_thresholds():
    """B(u): b_min from tau_h on (inclusive), b_max below tau_l, b_mid between (tau_l inclusive)."""
    c = DynaTreeConfig(hw_budget="off")
    pol = DynaTree(c)
    assert pol._branching(0, c.tau_h) == c.b_min and pol._branching(0, c.tau_h - 0.01) == c.b_mid
    assert pol._branching(0, c.tau_l) == c.b_mid and pol._branching(0, c.tau_l - 0.01) == c.b_max


def test_history_waits_for_a_full_window_steps_at_the_thresholds_and_caps_tau_h():
    """Nothing moves until W values are in the window; a mean exactly at hist_high counts as
    high; tau_h rises by 0.05 at most to 0.99."""
    cfg = DynaTreeConfig(hw_budget="off", window=4, hist_high=0.75)
    up = DynaTree(cfg)
    for ok in (3, 3, 3):
        up.observe(ok, _chain(3), [0, 1, 2, 3][:ok + 1])
    assert up.d0 == cfg.d0 and up.tau_h == cfg.tau_h  # three of four: no step yet
    up.observe(0, _chain(3), [0])  # mean (1 + 1 + 1 + 0) / 4 = 0.75 = hist_high
    assert up.d0 == cfg.d0 + 1
    high = DynaTreeConfig(hw_budget="off", window=2, tau_h=0.97)
    down = DynaTree(high)
    for _ in range(2):
        down.observe(0, _chain(3), [0])
    assert down.tau_h == 0.99 and down.d0 == high.d0 - 1


def test_calibration_learns_each_sibling_at_its_rank():
    """Children of a node on the accepted path are tested at their rank among siblings (0, 1, 2,
    ...): the first choice rejected, the second accepted, the third rejected."""
    import math

    from dynatree.budget import Calibration
    from dynatree.config import DynaTreeConfig as C

    pol = DynaTree(C())
    pol.calib = Calibration()
    t = Tree.root_only(0)
    t.add(0, 5, math.log(0.52), 0)
    b = t.add(0, 6, math.log(0.32), 1)
    t.add(0, 7, math.log(0.12), 2)
    pol.observe(1, t, [0, b])
    cal = pol.calib
    assert (cal.tested[0][10], cal.accepted[0][10]) == (1, 0)
    assert (cal.tested[1][6], cal.accepted[1][6]) == (1, 1)
    assert (cal.tested[2][2], cal.accepted[2][2]) == (1, 0)


def test_calibration_learns_a_kept_proposal_at_its_draft_rank_not_its_place_among_kept_siblings():
    """The budget may verify a parent's first and third proposals but not its second (the third's
    cell priced higher).  The verified tree the policy observes is the kept, flattened one, where
    the third proposal is the second child -- it must still teach rank 2's cell, or rank 2 keeps
    its optimistic prior and is preferred forever (measured on the bench pair: 16% accepted,
    priced at 67-100%)."""
    import math

    from dynatree.budget import Calibration
    from dynatree.config import DynaTreeConfig as C
    from dynatree.tree import flatten_bfs

    pol = DynaTree(C())
    pol.calib = Calibration()
    t = Tree.root_only(0)
    a = t.add(0, 5, math.log(0.52), 0)
    t.add(0, 6, math.log(0.32), 1)
    c = t.add(0, 7, math.log(0.12), 2)
    t.keep = [0, a, c]
    flat, order = flatten_bfs(t)
    assert flat.ranks == [0, 0, 2] and order == [0, a, c]
    pol.observe(1, flat, [0, 1])
    cal = pol.calib
    assert (cal.tested[0][10], cal.accepted[0][10]) == (1, 1)
    assert (cal.tested[2][2], cal.accepted[2][2]) == (1, 0)
    assert cal.rank_tested == [1, 0, 1, 0]


def test_linear_drafts_no_deeper_than_the_engine_allows():
    """Linear drafts min(k, max_depth) tokens: the engine's cap (tokens left) binds."""
    from dynatree.config import LinearConfig
    from dynatree.drafting import run
    from dynatree.policies import Linear

    pol = Linear(LinearConfig(k=4))
    assert run(None, pol.grow(_FakeDraft(), 1, 2)).tokens == [1, 10, 20 + 1]
    assert len(run(None, pol.grow(_FakeDraft(), 1, 8))) == 5


def test_every_grower_records_each_nodes_rank_among_its_parents_proposals():
    """Tree.ranks is the draft rank a node was proposed at (what the calibration learns by): the
    level grower (the paper's DynaTree), DySpec's heap and the budgeted grower all record it."""
    def proposal_rank(tree, u):
        p = tree.parents[u]
        return ([10, 11, 12] if p == 0 else [20 + p, 40 + p]).index(tree.tokens[u])

    trees = [DynaTree(DynaTreeConfig(hw_budget="off")).grow(_FakeDraft(), 1, 3),
             DySpecHeap(DySpecConfig(mode="heap", budget=6, max_branch=3, max_depth=3)).grow(_FakeDraft(), 1, 3)]
    for gen in trees:
        with pytest.raises(StopIteration) as stop:
            gen.send(None)
        tree = stop.value.value
        assert tree.ranks == [0] + [proposal_rank(tree, u) for u in range(1, len(tree))]
        assert 1 in tree.ranks  # a second choice is among them
    assert _budgeted(_free(), _calibrated(), tau=0.5).ranks == [0, 0, 1]
