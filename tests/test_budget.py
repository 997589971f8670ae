"""The hardware-aware budget's pieces: latency interpolation, node selection, calibration."""
import pytest

from dynatree.budget import BatchView, Calibration, LatencyModel, select, worth_drafting
from dynatree.tree import Tree, flatten_bfs


def test_latency_interpolates_and_extrapolates():
    lat = LatencyModel({1: 10.0, 4: 16.0, 8: 20.0}, {1: 2.0, 4: 2.5})
    assert lat.verify(1) == 10.0 and lat.verify(2) == 12.0 and lat.verify(6) == 18.0
    assert lat.verify(12) == 24.0 and lat.draft(16) > lat.draft(4)


def test_latency_follows_the_cache_length():
    """Profiled at 256 and 1024 cached tokens: a row's verification is priced at its own cache
    length (linear in it, as attention is), and a longer cache makes the same tree dearer, so
    node selection stops earlier."""
    lat = LatencyModel({1: 2.0, 8: 4.0}, {1: 0.1, 4: 0.2}, overhead_ms=0.0, long_ms={1: 3.0, 8: 7.0}, short_at=256, long_at=1024)
    assert lat.verify(8) == 4.0 and lat.verify(8, 256) == 4.0 and lat.verify(8, 1024) == 7.0
    assert lat.verify(8, 640) == 5.5 and lat.verify(8, 1792) == 10.0
    row = lat.view(0, 1, cached=1792)
    assert row.verify(8) == 10.0 and lat.view(0, 1) is lat
    lat.observe_verify(8, 10.0, cached=1792)  # exactly as profiled at that length: no correction
    assert lat.verify_extra_ms == 0.0
    values = [0.9, 0.6, 0.4, 0.3, 0.25, 0.2, 0.15]
    assert select(values, lat.view(0, 1, cached=1792), 0.0)[0] < select(values, lat.view(0, 1, cached=256), 0.0)[0]


def test_select_stops_where_tokens_per_ms_peak():
    # verification costs 10 ms + 1 ms per extra token; no overhead, nothing spent drafting
    lat = LatencyModel({1: 10.0, 2: 11.0, 64: 73.0}, {1: 2.0, 2: 2.0}, overhead_ms=0.0)
    k, rate, delta = select([0.9, 0.8, 0.5, 0.05, 0.01], lat, spent_ms=0.0)
    assert k == 3  # 0.05 tokens for 1 ms would lower 3.2 tokens / 13 ms
    assert abs(rate - (1 + 0.9 + 0.8 + 0.5) / 13.0) < 1e-9 and abs(delta - 1.0) < 1e-9
    assert select([], lat, 0.0)[0] == 0


def test_the_iteration_overhead_is_measured_and_an_overstated_one_grows_trees():
    """An iteration's time outside its forwards is learned online, clipped at a one-token forward
    (a stall must not price trees for long); overstated, it makes extra nodes look cheap beside
    it, and the budget verifies more of them -- why a constant 1 ms was replaced."""
    lat = LatencyModel({1: 1.0, 2: 1.05, 64: 8.0}, {1: 0.1, 2: 0.1}, overhead_ms=1.0)
    for _ in range(60):
        lat.observe_overhead(0.15)
    assert abs(lat.overhead_ms - 0.15) < 0.01
    lat.observe_overhead(50.0)  # one stall: counted as a one-token forward at most
    assert abs(lat.overhead_ms - (0.15 + 0.1 * (1.0 - 0.15))) < 0.01
    lat.observe_overhead(-3.0)
    assert lat.overhead_ms > 0
    values = [0.8, 0.5, 0.3, 0.2, 0.12, 0.1, 0.08, 0.06]
    small = select(values, LatencyModel({1: 1.0, 2: 1.05, 64: 8.0}, {1: 0.1, 2: 0.1}, overhead_ms=0.15), 0.3)[0]
    large = select(values, LatencyModel({1: 1.0, 2: 1.05, 64: 8.0}, {1: 0.1, 2: 0.1}, overhead_ms=1.0), 0.3)[0]
    assert small < large


def test_calibration_learns_a_poorly_calibrated_draft():
    cal = Calibration()
    assert cal(0.3) == 1.0  # an optimistic prior: untested cells get tested
    for _ in range(200):
        cal.update(0.3, True, rank=0)
        cal.update(0.3, True, rank=0)
        cal.update(0.3, False, rank=0)
        cal.update(0.3, False, rank=1)  # the same q as a second choice: rarely right
    assert 0.6 < cal(0.3) < 0.7 and 0.6 < cal.top1() < 0.7
    assert cal(0.3, rank=1) < 0.02
    assert cal(0.3, rank=2) == 1.0  # an untouched rank keeps the optimistic start
    assert cal(0.9) == cal.top1()  # an untouched cell of a measured rank starts at the rank's acceptance


def test_flatten_keeps_only_selected_nodes():
    t = Tree.root_only(10)
    a = t.add(0, 11, -0.1)
    t.add(0, 12, -3.0)
    c = t.add(a, 13, -0.2)
    t.keep = [0, a, c]
    flat, order = flatten_bfs(t)
    assert flat.tokens == [10, 11, 13] and flat.parents == [-1, 0, 1] and order == [0, 1, 3]


def test_drafting_looks_past_one_level():
    # verification nearly flat from 2 to 8 tokens, 2 ms per draft level, rate 0.13 tokens/ms
    lat = LatencyModel({1: 9.0, 2: 12.0, 8: 13.0, 16: 18.0}, {1: 2.0, 16: 2.0}, overhead_ms=0.0)
    # one level: 0.6 tokens for 2 + 3 ms does not beat the rate (0.65); two levels, 0.96 tokens
    # for 4 + 3.17 ms, do (0.93)
    assert worth_drafting([1.0], 0.6, 0.13, lat, 1)
    assert not worth_drafting([1.0], 0.6, 0.13, lat, 1, horizon=1)
    assert not worth_drafting([0.05], 0.6, 0.13, lat, 1)


class ChainDrafter:
    """A stand-in drafter: every node's top-k is tokens 1..k with probabilities 0.6, 0.2, 0.1."""

    seconds = 0.0

    def root(self, k):  # generators like drafting.Drafter's, that never need a forward
        return [0.6, 0.2, 0.1][:k], [1, 2, 3][:k]
        yield

    def expand(self, tree, nodes, k):
        return [[0.6, 0.2, 0.1][:k]] * len(nodes), [[1, 2, 3][:k]] * len(nodes)
        yield


def test_lookup_hint_raises_the_bar_for_drafted_nodes():
    """Confident lookup nodes to come compete for the same verification time: the budget keeps
    no more drafted nodes than without them, and asks more of a further node (tree.bar)."""
    from dynatree.drafting import run
    from dynatree.policies import grow_budgeted

    lat = LatencyModel({1: 3.0, 2: 3.2, 4: 3.6, 8: 4.6, 16: 8.0, 32: 15.0, 64: 30.0}, {1: 0.2, 4: 0.3, 16: 0.6})
    calib = Calibration()
    for i in range(200):  # first choices right 60% of the time, second ones 10%
        calib.update(0.6, i % 10 < 6, rank=0)
        calib.update(0.2, i % 10 == 0, rank=1)
    kw = dict(max_depth=8, max_nodes=64, kmax=3, n_children=lambda u, c: 2, gate=lambda d, v: d < 8, tau=0.0,
              lat=lat, calib=calib)
    plain = run(None, grow_budgeted(ChainDrafter(), 7, **kw))
    hinted = run(None, grow_budgeted(ChainDrafter(), 7, hint=[0.95 ** (j + 1) for j in range(12)], **kw))
    assert len(plain.keep) > 1  # without a hint the budget verifies drafted nodes
    assert len(hinted.keep) < len(plain.keep) and hinted.bar > plain.bar


def test_held_nodes_share_the_prior_and_leave_a_measured_cell_alone():
    cal = Calibration()
    cells = [cal.hold(0.3, 0) for _ in range(6)]  # six rows drafted into one untested cell
    assert cal(0.3) == 2 / 8  # the prior's two pseudo-acceptances spread over the eight
    for _ in range(300):
        cal.update(0.8, True, rank=0)
        cal.update(0.8, False, rank=0)
    measured = cal(0.8)
    cells += [cal.hold(0.8, 0) for _ in range(64)]
    assert abs(cal(0.8) - measured) < 1e-3  # held at the observed mean: no pessimism once measured
    cal.release(cells)
    assert cal(0.3) == cal.top1() and cal(0.8) == measured  # the untested cell: its rank's acceptance


def test_a_batch_releases_every_held_node(close_pair):
    from dynatree import make_config
    from dynatree.engine import decode_batch

    from conftest import random_prompts
    prompts = random_prompts(5, seed=3)
    decode_batch(close_pair, prompts, make_config("dynatree"), max_new_tokens=20, ignore_eos=True)
    cal = close_pair.state[("calibration", "greedy")]
    assert sum(map(sum, cal.tested)) > 0 and not any(map(any, cal.held))


def _drive(g, n: int, plain: float, drafted: float, rows: int = 4) -> list[bool]:
    """n iterations of 1 ms committing ``plain`` or ``drafted`` tokens; whether each was plain."""
    kinds = []
    for _ in range(n):
        skip = g.skip_drafting(rows)
        kinds.append(skip)
        g.observe(plain if skip else drafted, 1.0, skip)
    return kinds


def test_governor_turns_drafting_down_when_it_loses_and_back_when_it_wins():
    from dynatree.budget import Governor

    g = Governor(segment=2, every=4, max_gap=8)
    kinds = _drive(g, 80, plain=2, drafted=1)  # drafting loses
    assert kinds[:4] == [True, True, False, False]  # a plain segment first, then a drafted one
    assert g.scale > 1.3 and sum(kinds[-40:]) >= 34  # mostly plain iterations, trees still explored
    starts = [i for i in range(0, 80, 2) if not kinds[i]]  # drafted segments
    assert len(starts) >= 4 and starts[-1] > 40
    assert g.gap == g.max_gap and starts[-1] - starts[-2] > starts[2] - starts[1]  # explored ever more rarely
    _drive(g, 400, plain=2, drafted=4)  # now drafting wins
    assert g.scale == 1.0 and g.gap == 1
    g.probe_cost = 1.0  # (one plain segment in `every`, however far trees win: see the next test)
    assert sum(_drive(g, 16, plain=2, drafted=4)) == 4  # only every 4th segment is plain
    g = Governor(segment=2, every=4, max_gap=8)
    _drive(g, 80, plain=2, drafted=2.05)  # a tie, inside the margin, goes to plain steps
    assert g.gap == g.max_gap


def test_governor_brings_trees_back_after_a_losing_first_segment():
    """A batch's first trees cost more than later ones (a fresh history): a slow first drafted
    iteration is one of a segment's eight, and a whole losing first segment sends trees away only
    until they are measured winning."""
    from dynatree.budget import Governor

    g = Governor(probe_cost=1.0)  # (one plain segment in `every` while trees win)
    kinds = []
    for i in range(80):  # the first drafted iteration commits 0.5 tokens in its ms, the rest 2.6 against 2
        skip = g.skip_drafting(4)
        kinds.append(skip)
        g.observe(2 if skip else (0.5 if kinds.count(False) == 1 else 2.6), 1.0, skip)
    assert sum(kinds) == 3 * g.segment and g.gap == 1  # the first segment and every 4th: ar's
    g = Governor(probe_cost=1.0)
    kinds = []
    for i in range(320):  # now the whole first drafted segment commits 1 token/ms
        skip = g.skip_drafting(4)
        kinds.append(skip)
        g.observe(2 if skip else (1 if kinds.count(False) <= g.segment else 2.6), 1.0, skip)
    assert kinds[8:16] == [False] * 8 and kinds[16:24] == [True] * 8  # lost: plain segments follow
    assert g.gap == 1 and sum(kinds[-64:]) == 2 * g.segment  # back: only every 4th segment plain


def test_governor_probes_plain_steps_less_often_the_more_trees_win():
    """While drafting wins, the plain segments that keep ar's rate measured cost at most
    probe_cost of the time: one in ``every`` where trees win narrowly, one in more where they win
    by far (each plain segment runs at ar's rate instead of the trees'), at most max_gap."""
    from dynatree.budget import Governor

    g = Governor(segment=2, every=4, max_gap=32)
    _drive(g, 200, plain=2, drafted=2.3)  # trees win by 15%: a probe loses 13% of a segment
    assert g.cycle() == 4 and sum(_drive(g, 80, plain=2, drafted=2.3)) == 80 // 4
    g = Governor(segment=2, every=4, max_gap=32)
    _drive(g, 200, plain=2, drafted=4)  # trees win 2x: a probe loses half a segment
    assert g.cycle() == 10 and sum(_drive(g, 200, plain=2, drafted=4)) == 200 // 10
    g.tree_rate = 100 * g.ar_rate  # a probe loses at most its whole segment: one in 1 / probe_cost
    assert g.cycle() == 20
    g.probe_cost = 0.01
    assert g.cycle() == g.max_gap
    assert g.carry().probe_cost == g.probe_cost


def test_a_governor_segment_is_one_row_count():
    """Rows that finish change what a step costs and commits: a segment under way when the row
    count changes is dropped, not mixed into a rate."""
    from dynatree.budget import Governor

    g = Governor(segment=4)
    _drive(g, 3, plain=4, drafted=4, rows=4)
    _drive(g, 4, plain=1, drafted=1, rows=3)  # a 3-row segment from its start
    assert g.ar_n == 1 and g.ar_rate == 1.0


def test_a_governor_carries_its_lesson_to_the_next_batch_of_its_size():
    """A run of short batches does not learn from scratch, nor is locked out: the next batch's
    governor keeps the scale, the losing gap and its count through it, and measures both rates
    afresh; batches too short to reach a drafted segment reach one in turn."""
    from dynatree.budget import Governor

    g = Governor(segment=2, max_gap=8)
    kinds = _drive(g, 80, plain=2, drafted=1)
    nxt = g.carry()
    assert (nxt.gap, nxt.plain_run, nxt.scale) == (g.max_gap, g.plain_run, g.scale)
    assert nxt.ar_rate is None and nxt.tree_rate is None
    drafted = 0
    for _ in range(12):  # short batches of 3 segments: with the count carried, trees are still tried
        kinds = _drive(nxt, 6, plain=2, drafted=1)
        drafted += kinds.count(False)
        nxt = nxt.carry()
    assert drafted >= 2 * 2  # at least twice: 36 segments over gaps of 8


def test_batch_decoders_keep_a_governor_per_batch_size_and_method_and_carry_it(close_pair):
    """engine.BatchDecoder asks the governor of its row count's power of two and its rows' config;
    a later decoder's starts from the pair's last one of that key; a batch of one asks none."""
    from conftest import random_prompts
    from dynatree import make_config
    from dynatree.engine import BatchDecoder, decode_batch

    for key in [k for k in close_pair.state if isinstance(k, tuple) and k[:1] == ("governor",)]:
        del close_pair.state[key]  # (the pair is shared by other tests' batches)
    cfg = make_config("dynatree")
    decode_batch(close_pair, random_prompts(4, seed=3), cfg, max_new_tokens=20, ignore_eos=True)
    first = close_pair.state[("governor", 4, cfg)]
    assert first.iteration > 0
    first.scale, first.gap = 4.0, 8  # as if trees had lost
    dec = BatchDecoder(close_pair)
    for i, p in enumerate(random_prompts(3, seed=4)):
        dec.add(p, cfg, max_new_tokens=20, key=i)
    dec.step()
    (key, g), = dec.governors.items()
    assert key == ("governor", 4, cfg) and g is close_pair.state[key] and g is not first
    assert (g.scale, g.gap, g.ar_rate) == (4.0, 8, None)
    other = make_config("dynatree", {"lookup": 0})
    decode_batch(close_pair, random_prompts(2, seed=5), [cfg, other], max_new_tokens=4, ignore_eos=True)
    assert ("governor", 2, None) in close_pair.state  # mixed configs share one
    decode_batch(close_pair, random_prompts(1, seed=6), cfg, max_new_tokens=4, ignore_eos=True)
    assert not any(k[1] == 1 for k in close_pair.state if isinstance(k, tuple) and k[:1] == ("governor",))
    # rows drawn with new seeds (a service's requests) share their sampling config's governor
    govs = lambda: {k for k in close_pair.state if isinstance(k, tuple) and k[:1] == ("governor",)}
    before = govs()
    for seeds in ((1, 2), (3, 4), (5, 5)):
        decode_batch(close_pair, random_prompts(2, seed=7), [make_config("dynatree", {"temperature": 0.8, "seed": s})
                                                             for s in seeds], max_new_tokens=4, ignore_eos=True)
        assert govs() - before == {("governor", 2, make_config("dynatree", {"temperature": 0.8}))}


def test_what_a_pair_learned_per_sampling_setting_is_bounded(close_pair, monkeypatch):
    """A service sending each request at its own temperature added a calibration (and lookup
    statistics, and at batch a governor) per temperature for the process's life (the Python API
    trial: 400 temperatures, 400 entries); the pair keeps LEARNED_KEPT of a kind, the least
    recently used dropped first."""
    from conftest import random_prompts
    from dynatree import decode, make_config, models

    monkeypatch.setattr(models, "LEARNED_KEPT", 3)
    kind = lambda: [k for k in close_pair.state if isinstance(k, tuple) and k[0] == "calibration"]
    for k in kind():
        del close_pair.state[k]
    prompt = random_prompts(1, seed=8)[0]
    for t in (0.5, 0.6, 0.7, 0.8):
        decode(close_pair, prompt, make_config("dynatree", {"temperature": t}), max_new_tokens=3)
    kept = kind()
    assert len(kept) == 3 and [k[2] for k in kept] == [0.6, 0.7, 0.8]
    first = close_pair.state[kept[0]]
    decode(close_pair, prompt, make_config("dynatree", {"temperature": 0.6}), max_new_tokens=3)  # used: kept
    decode(close_pair, prompt, make_config("dynatree", {"temperature": 0.9}), max_new_tokens=3)
    assert [k[2] for k in kind()] == [0.8, 0.6, 0.9] and close_pair.state[kind()[1]] is first
    assert "target=" not in repr(close_pair) and "GPTNeoX" not in repr(close_pair)  # (not both module trees)


def test_profile_is_kept_per_machine_and_measured_again_on_request(pair_dirs, tmp_path, monkeypatch):
    """The budget's profile is saved on disk and reused by the next pair of the same models; a
    fresh profile (`dynatree profile`) measures again whatever was saved."""
    from dynatree import budget, load_pair

    monkeypatch.setenv("DYNATREE_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(budget, "_profile_model", lambda model, n, sizes, reps, kv: calls.append((n, kv)) or
                        {s: float(s) for s in sizes})

    def pair():
        return load_pair(str(pair_dirs / "target"), str(pair_dirs / "draft"), device="cpu", dtype="float32")

    first = budget.profile(pair(), prefix_len=16)
    measured = len(calls)
    assert measured >= 2 and list((tmp_path / "profiles").glob("*.json"))
    assert budget.profile(pair(), prefix_len=16).verify_ms == first.verify_ms and len(calls) == measured
    budget.profile(pair(), prefix_len=16, fresh=True)
    assert len(calls) == 2 * measured and {kv for _, kv in calls} == {"model"}
    # a bfloat16 cache streams half the bytes: its forwards are profiled over such caches, kept apart
    p = pair()
    assert budget.profile(p, prefix_len=16, kv_dtype="bfloat16") is not budget.profile(p, prefix_len=16)
    assert [kv for _, kv in calls[2 * measured:]] == ["bfloat16"] * measured
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 2
    # models named by hub id are keyed by their snapshot in the Hugging Face cache (they never were:
    # every actor of a Pythia job profiled again)
    import dynatree.names
    monkeypatch.setattr(dynatree.names, "_cached_config", lambda name: str(pair_dirs / name.split("/")[1] / "config.json"))
    local = budget._disk_path(p, (16,))
    p.names.update(target="org/target", draft="org/draft")
    assert local is not None and budget._disk_path(p, (16,)) == local


def test_a_dynatree_with_a_bfloat16_cache_prices_its_nodes_with_a_bfloat16_profile(pair_dirs, tmp_path,
                                                                                   monkeypatch):
    from dynatree import budget, load_pair, make_config
    from dynatree.policies import make_policy

    monkeypatch.setenv("DYNATREE_CACHE", str(tmp_path))
    stores = []
    real = budget.new_cache
    monkeypatch.setattr(budget, "new_cache", lambda *a: stores.append(a[2:]) or real(*a))
    pair = load_pair(str(pair_dirs / "target"), str(pair_dirs / "draft"), device="cpu", dtype="float32")
    policy = make_policy(make_config("dynatree", {"kv_dtype": "bfloat16"}))
    policy.attach(pair)
    assert policy.latency is pair.state[("latency", 256, "bfloat16")]
    assert stores and all(s == ("bfloat16",) for s in stores)  # every timed forward ran over bf16 caches


def test_calibration_survives_an_accepted_node_the_draft_gave_probability_zero():
    """At a sharp temperature the draft's lower ranks underflow to probability 0 (log -inf); the
    target may still accept one, and its children's q cannot be recovered (it was NaN, and the
    whole batch failed).  The node itself is a q = 0 observation; its children teach nothing."""
    import math

    from dynatree import make_config
    from dynatree.policies import DynaTree

    pol = DynaTree(make_config("dynatree"))
    pol.calib = Calibration()
    tree = Tree.root_only(0)
    tree.add(0, 2, math.log(0.9), 0)  # the draft's rank-0 child, rejected
    a = tree.add(0, 1, -math.inf, 1)  # rank 1, probability 0: accepted
    tree.add(a, 3, -math.inf)  # below the accepted one
    pol.observe(2, tree, [0, a, 3])
    assert sum(map(sum, pol.calib.tested)) == 2 and pol.calib.accepted[1][0] == 1


def test_a_profile_spike_is_capped_by_the_larger_sizes():
    """A size timed while the machine was busy must not price trees off for good (seen: a cached
    8-token forward at 49 ms beside 1.9 ms for 12 tokens kept every tree at zero nodes)."""
    from dynatree.budget import _envelope

    spiked = {1: 0.84, 2: 0.91, 4: 0.92, 8: 49.3, 12: 1.9, 16: 2.76, 32: 8.6, 64: 19.0}
    assert _envelope(spiked) == {**spiked, 8: 1.9} and list(_envelope(spiked)) == sorted(spiked)
    assert _envelope({1: 1.0, 4: 3.0, 16: 1.5}) == {1: 1.0, 4: 1.5, 16: 1.5}
    assert _envelope({1: 1.06, 2: 0.98, 4: 1.07}) == {1: 1.06, 2: 0.98, 4: 1.07}  # noise stays


def test_dynatree_thresholds_must_be_ordered():
    """hist_high below hist_low would make the history rules fight each other: refused."""
    import pytest

    from dynatree import make_config
    for bad in ({"hist_high": 0.1}, {"hist_low": 0.8}, {"hist_low": -0.1}):
        with pytest.raises(ValueError, match="need 0 <= hist_low < hist_high <= 1"):
            make_config("dynatree", bad)


def test_profile_caches_hold_zero_keys_and_slow_forwards_are_timed_fewer_times(pair_dirs, monkeypatch):
    """The profiled forwards read prefix_len cached tokens without a prefill of them (zero keys and
    values: the same reads and FLOPs), and a forward slower than PROFILE_MS / repeats is timed
    fewer times, at least once (Pythia-2.8B-sized forwards took most of a job's start-up)."""
    from dynatree import budget, load_pair

    runner = load_pair(str(pair_dirs / "target"), None, device="cpu", dtype="float32").runner("target")
    seen, lengths = [], []
    real = budget._zero_prefix

    def zero(model, cache, n, vocab, gen):
        real(model, cache, n, vocab, gen)
        lengths.append(cache.length)
        assert all(not layer.keys[:, :, :n].any() for layer in cache.layers)

    class Counting:
        def __init__(self, run):
            self.run = run

        def __getattr__(self, name):  # device, dtype, config, tree_problem: the runner's
            return getattr(self.run, name)

        def __call__(self, input_ids, **kw):
            seen.append((input_ids.shape[1], kw["past_key_values"].length))
            return self.run(input_ids=input_ids, **kw)

    monkeypatch.setattr(budget, "_zero_prefix", zero)
    monkeypatch.setattr(budget, "PROFILE_MS", 1e9)  # every forward fast against it (a loaded host's too)
    ms = budget._profile_model(Counting(runner), 24, (1, 4), 5)
    assert lengths == [24] and set(ms) == {1, 4} and all(v > 0 for v in ms.values())
    timed = [n for n, past in seen if past == 24]  # (the layout's one token runs over an empty cache)
    assert timed.count(1) == timed.count(4) == 6  # warm-up + 5
    monkeypatch.setattr(budget, "PROFILE_MS", 1e-6)
    seen.clear()
    budget._profile_model(Counting(runner), 24, (1, 4), 5)
    timed = [n for n, past in seen if past == 24]
    assert timed.count(1) == timed.count(4) == 2  # warm-up + once


def test_batch_view_charges_a_row_its_share_of_the_base_cost():
    """A row of a batch pays its share of the forward's base cost plus its own nodes' marginal
    cost on top of the others' rows: charged the whole base, trees would shrink at any B > 1."""
    lat = LatencyModel(verify_ms={1: 2.0, 4: 4.0, 8: 8.0, 64: 64.0}, draft_ms={1: 1.0, 16: 2.0})
    view = BatchView(lat, others=3, share=4)
    assert view.verify(1) == pytest.approx(lat.verify(4) / 4)  # a bare root: a quarter of the 4-root forward
    assert view.verify(3) == pytest.approx(lat.verify(4) / 4 + lat.verify(3 + 3) - lat.verify(3 + 1))  # its own 3 nodes on the others' 3


def test_latency_corrections_are_clipped_and_priced_into_every_forward():
    """A residual is clipped to [-1/2, +1] x the profiled time at that size before its EMA step
    (0.1): one stall or one lucky forward must not price trees off, or on, for long.  The
    corrections are added to every later price, and the draft's fades each iteration (relax) by
    1 - ema/4 unless levels keep confirming it."""
    lat = LatencyModel({1: 10.0, 64: 10.0}, {1: 2.0, 16: 4.0}, overhead_ms=0.0)
    lat.observe_verify(1, 0.0)  # 10 ms faster than profiled: counted as 5 ms faster
    assert lat.verify_extra_ms == pytest.approx(-0.5) and lat.verify(1) == pytest.approx(9.5)
    lat = LatencyModel({1: 10.0, 64: 10.0}, {1: 2.0, 16: 4.0}, overhead_ms=0.0)
    lat.observe_verify(1, 100.0)  # a 90 ms stall: counted as 10 ms
    assert lat.verify_extra_ms == pytest.approx(1.0) and lat.verify(8) == pytest.approx(11.0)
    lat.observe_draft(16, 0.0)  # priced against the 16-wide level's 4 ms, not a 1-wide one's 2 ms
    assert lat.draft_extra_ms == pytest.approx(-0.2)
    lat = LatencyModel({1: 10.0, 64: 10.0}, {1: 2.0, 16: 4.0}, overhead_ms=0.0)
    lat.observe_draft(16, 100.0)
    assert lat.draft_extra_ms == pytest.approx(0.4) and lat.draft(16) == pytest.approx(4.4)
    lat.relax()
    assert lat.draft_extra_ms == pytest.approx(0.4 * (1 - 0.1 / 4))


def test_batch_view_applies_the_governor_scale_and_shares_the_rest():
    """In a batch (``view``), the Governor's scale multiplies only a row's *marginal* costs (its
    own nodes, its share of a draft level over all rows' frontiers), never its share of the base
    forward; the iteration overhead and drafting wall time are split over the rows, and a
    row's draft-level timing is attributed to the level's whole width."""
    lat = LatencyModel(verify_ms={1: 2.0, 4: 4.0, 8: 8.0, 64: 64.0}, draft_ms={1: 1.0, 16: 2.0}, overhead_ms=0.8)
    view = lat.view(3, 4, scale=2.0)
    assert isinstance(view, BatchView) and view.scale == 2.0
    # base: the 4-root forward's quarter (1 ms); marginal: 3 nodes on the others' 3 (6 - 4 ms), x 2
    assert view.verify(3) == pytest.approx(1.0 + 2.0 * 2.0)
    assert view.draft(2) == pytest.approx(2.0 * lat.draft(8) / 4) and lat.draft(8) == pytest.approx(1 + 7 / 15)
    assert view.overhead_ms == pytest.approx(0.2) and view.spent(8.0) == pytest.approx(2.0)
    view.observe_draft(4, 3.0)  # a 16-wide level (profiled 2 ms) took 3 ms: +1 ms, EMA 0.1
    assert lat.draft_extra_ms == pytest.approx(0.1)


def test_governor_backs_off_geometrically_and_recovers_by_halves():
    """Each losing drafted segment multiplies the scale by 1.1 (to max_scale) and doubles the gap
    (to max_gap); a winning one divides the scale by 1.05 and halves the gap -- one lucky segment
    is not a trend, so neither is reset."""
    from dynatree.budget import Governor

    g = Governor(segment=1, max_gap=32, max_scale=1.5)
    gaps, scales = [], []
    while len(gaps) < 7:  # plain segments commit 2 tokens/ms; six drafted ones 1, then one 10
        skip = g.skip_drafting(4)
        g.observe(2 if skip else (1 if len(gaps) < 6 else 10), 1.0, skip)
        if not skip:
            gaps.append(g.gap)
            scales.append(g.scale)
    assert gaps == [2, 4, 8, 16, 32, 32, 16]  # the win (tree rate 1 + 0.3 x 9 = 3.7) halves the gap
    assert scales[:6] == pytest.approx([1.1, 1.21, 1.331, 1.4641, 1.5, 1.5])
    assert scales[6] == pytest.approx(1.5 / 1.05) and g.winning()


def test_governor_ties_at_the_margin_go_to_drafting():
    """winning() is tree_rate >= ar_rate x (1 + margin): exactly at the margin trees win."""
    from dynatree.budget import Governor

    g = Governor(margin=0.5, ar_rate=1.0, tree_rate=1.5)
    assert g.winning()
    g.tree_rate = 1.25
    assert not g.winning()


def test_governor_pause_drops_the_segment_under_way():
    """pause(): iterations before and after a batch moved to another size's governor are far
    apart, so the half-finished segment is dropped, not completed with later iterations."""
    from dynatree.budget import Governor

    g = Governor(segment=4)
    for _ in range(2):
        g.observe(8, 1.0, g.skip_drafting(4))  # the first, plain, segment: 8 tokens/ms so far
    g.pause()
    for _ in range(4):
        g.observe(1, 1.0, g.skip_drafting(4))  # a whole new plain segment at 1 token/ms
    assert g.ar_n == 1 and g.ar_rate == 1.0


def test_calibration_pools_ranks_three_and_later_only():
    """Ranks 0, 1, 2 and "3 or later" are calibrated apart: a third choice's record says nothing
    of a fourth's, while the fourth and the sixth share one."""
    cal = Calibration()
    for _ in range(50):
        cal.update(0.3, False, rank=2)
    assert cal(0.3, rank=2) < 0.05 and cal(0.3, rank=3) == 1.0
    cal.update(0.3, False, rank=5)
    assert cal.tested[3][6] == 1 and cal(0.3, rank=3) == cal(0.3, rank=7) < 1.0


def test_drafting_pays_for_every_level_and_every_frontier_node():
    """worth_drafting charges L draft levels for an L-level look-ahead, and the verification of
    L x width more tokens; a gain only equal to its cost does not pay."""
    # verification 10 ms + 1 ms per extra token, 1 ms per draft level whatever its width
    lat = LatencyModel({1: 10.0, 64: 73.0}, {1: 1.0, 64: 1.0}, overhead_ms=0.0)
    # four frontier nodes worth 0.5 each, a = 0.5: one level adds 1 token for 1 + 4 ms
    assert not worth_drafting([0.5] * 4, 0.5, 0.3, lat, 1)
    # one node worth 1, a = 0.6 (verification here 3 ms per token): three levels, 1.176 tokens for
    # 3 x 2 + 3.33 ms, do not pay at 0.2 tokens/ms (nor do one or two levels)
    steep = LatencyModel({1: 9.0, 2: 12.0, 8: 13.0, 16: 18.0}, {1: 2.0, 16: 2.0}, overhead_ms=0.0)
    assert not worth_drafting([1.0], 0.6, 0.2, steep, 1)
    # a tie: 0.5 tokens for 1 + 1 ms at 0.25 tokens/ms
    assert not worth_drafting([1.0], 0.5, 0.25, lat, 1, horizon=1)
    assert worth_drafting([1.0], 0.5, 0.2499, lat, 1, horizon=1)


def test_select_counts_drafting_time_ties_and_the_marginal_cost_past_its_choice():
    """select: the bare root's rate also pays the drafting time already spent (else a tree that
    took long to draft looks worse than verifying nothing); a node that leaves the rate exactly
    where it was is not verified; delta is the marginal ms per token past the chosen size
    (k nodes + the root), at least 1e-3 / 4."""
    lat = LatencyModel({1: 10.0, 2: 11.0, 64: 73.0}, {1: 1.0, 2: 1.0}, overhead_ms=0.0)
    assert select([0.05], lat, 0.0)[0] == 0  # 1.05 / 11 ms < 1 / 10 ms
    assert select([0.05], lat, 20.0)[0] == 1  # 1.05 / 31 ms > 1 / 30 ms
    flat = LatencyModel({1: 10.0, 64: 10.0}, {1: 1.0, 64: 1.0}, overhead_ms=0.0)
    k, rate, delta = select([0.0], flat, 0.0)
    assert k == 0 and rate == pytest.approx(0.1) and delta == pytest.approx(1e-3 / 4)
    bent = LatencyModel({1: 10.0, 2: 12.0, 6: 16.0, 64: 16.0}, {1: 1.0, 64: 1.0}, overhead_ms=0.0)
    assert select([], bent, 0.0)[2] == pytest.approx((15.0 - 10.0) / 4)  # verify(5) - verify(1), not (4) - (0)
