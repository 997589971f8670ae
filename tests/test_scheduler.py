"""Continuous batching (scheduler.py): groups share batches, rows equal their batch-1 decode,
bad rows and failing steps stay contained; the batch-size tuner climbs to the measured best."""
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from dynatree import decode, make_config
from dynatree.scheduler import BatchTuner, Request, Scheduler

from conftest import random_prompts


def _requests(prompts, cfg, n=14):
    return [Request(p, cfg, n, ignore_eos=True) for p in prompts]


@pytest.mark.parametrize("batch_size", [1, 3, None])
def test_groups_share_batches_and_equal_batch1(close_pair, batch_size):
    dyna, ar = make_config("dynatree"), make_config("ar")
    prompts = random_prompts(7, seed=21, lo=2, hi=20)
    sched = Scheduler(close_pair, batch_size, max_batch=4, threads=1)
    groups = [_requests(prompts[:3], dyna), _requests(prompts[3:], ar) + _requests(prompts[:1], dyna)]
    with ThreadPoolExecutor(2) as pool:  # two callers, as two in-flight shards of one actor
        got = list(pool.map(lambda g: sched.submit(g).result(timeout=120), groups))
    for reqs, outs in zip(groups, got):
        for r, (toks, reason, m) in zip(reqs, outs):
            ref, ref_reason, _ = decode(close_pair, r.ids, make_config("ar"), max_new_tokens=14, ignore_eos=True)
            assert toks == ref and reason == ref_reason == "length" and m.new_tokens == 14
    assert sched.steps > 0


def test_bad_row_and_failing_step_are_contained(close_pair, monkeypatch):
    sched = Scheduler(close_pair, 2, threads=1)
    too_long = [5] * close_pair.max_context
    ok, bad = random_prompts(1, seed=3)[0], too_long
    out = sched.submit([Request(ok, make_config("ar"), 4), Request(bad, make_config("ar"), 4)]).result(timeout=60)
    assert out[0][0] and isinstance(out[1], ValueError) and "context" in str(out[1])

    from dynatree import engine
    real = engine.BatchDecoder._iterate
    calls = {"n": 0}

    def flaky(self, rows):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real(self, rows)

    monkeypatch.setattr(engine.BatchDecoder, "_iterate", flaky)
    with pytest.raises(RuntimeError, match="boom"):
        sched.submit([Request(ok, make_config("ar"), 6)]).result(timeout=60)
    again = sched.submit([Request(ok, make_config("ar"), 6)]).result(timeout=60)  # the thread lives on
    assert again[0][0] == decode(close_pair, ok, make_config("ar"), max_new_tokens=6)[0]


def _drive(tuner: BatchTuner, rate_of, windows: int = 40, available=None):
    sizes = []
    for _ in range(windows * 4):
        b = tuner.size
        tuner.observe(int(rate_of(b) * 0.5), 0.5, b, available=available, finished=b)
        sizes.append(b)
    return sizes


def test_tuner_climbs_to_the_best_size_and_rechecks():
    rate = {1: 60, 2: 110, 4: 190, 8: 300, 16: 380, 32: 385, 64: 300}
    t = BatchTuner(max_size=64, start=8, window_s=1.0)
    sizes = _drive(t, rate.get)
    assert t.best() == 16  # 32 is not 5% better than 16
    assert sizes[-40:].count(16) > 30  # settles, with occasional rechecks of the neighbours
    assert {8, 16, 32} <= set(sizes) and 64 not in sizes[-40:]
    t = BatchTuner(max_size=64, start=8, window_s=1.0)
    assert max(_drive(t, rate.get, available=20)) == 8  # too few rows left to try 16 and profit from it
    t = BatchTuner(max_size=64, start=8, window_s=1.0)
    assert max(_drive(t, rate.get, available=100)) == 16  # 4 x 32 rows are not left
    small_wins = {1: 60, 2: 110, 4: 300, 8: 250, 16: 200, 32: 150, 64: 100}  # (caches outgrow the L3)
    t = BatchTuner(max_size=64, start=16, window_s=1.0)
    sizes = _drive(t, small_wins.get, available=48)  # a 64-prompt job after its first turnover at 16:
    assert t.best() == 4 and sizes[-40:].count(4) > 30  # smaller sizes need fewer rows left to try
    t = BatchTuner(max_size=4, start=8, window_s=1.0)
    _drive(t, rate.get)
    assert t.best() == 4 and t.size <= 4
    t = BatchTuner(window_s=1.0)
    t.observe(1000, 10.0, t.size - 1, finished=64)  # a partly empty batch measures nothing
    t.observe(1000, 10.0, t.size + 1, finished=64)  # nor rows left over from a larger size
    assert t.rates == {}


def test_the_callers_backlog_is_the_tuners_horizon(close_pair):
    sched = Scheduler(close_pair, None, max_batch=4, threads=1)
    sched.tell_backlog(2000)
    sched.tell_backlog(1000)
    sched.tell_backlog(1500)  # told late (calls arrive in any order): the job's backlog only shrinks
    sched.submit(_requests(random_prompts(2, seed=5), make_config("ar"), n=3)).result(timeout=60)
    assert 1000 <= sched.tuner.available < 1010


def _lockstep(tuner: BatchTuner, steps: int, prefill_s: float = 0.05, new_tokens: int = 128):
    """A scheduler's steps where every row decodes the same number of tokens (EOS ignored): rows
    that join together finish together, and B prompts' prefill lands in one step.  A step's
    decode costs 4 ms + 0.3 ms a row + 0.02 ms a row squared, so B = 16 is the best size (8: 746,
    16: 799, 32: 692 tokens/s over whole cohorts)."""
    rows: list[int] = []
    for _ in range(steps):
        join = max(0, tuner.size - len(rows)) if len(rows) < tuner.size else 0
        rows += [new_tokens + 1] * join
        n = len(rows)
        seconds = join * prefill_s + 0.004 + 0.0003 * n + 0.00002 * n * n
        rows = [r - 1 for r in rows]
        done = sum(1 for r in rows if r <= 0)
        rows = [r for r in rows if r > 0]
        tuner.observe(n, seconds, n, available=10**6, finished=done)


def test_tuner_measures_whole_turnovers_of_rows_that_finish_together():
    """Each window holds at least B rows finishing, so each carries its cohorts' prefill once:
    windows of time alone counted a burst of B prefills once, twice or not at all, and settled
    on the wrong size."""
    t = BatchTuner(max_size=64, start=8, window_s=2.0)
    _lockstep(t, 20000)
    assert t.best() == 16 and t.size in (8, 16, 32)
    for b, true in {8: 746, 16: 799, 32: 692}.items():
        assert abs(t.rates[b] - true) < 0.08 * true, (b, t.rates[b])


def test_nothing_waits_forever_when_the_decoding_thread_dies(close_pair, monkeypatch):
    from dynatree import engine

    class Fatal(BaseException):  # not an Exception: escapes the per-step handler
        pass

    sched = Scheduler(close_pair, 2, threads=1)
    ok = random_prompts(2, seed=4)
    real_add = engine.BatchDecoder.add

    def add(self, ids, *a, **k):
        if ids == ok[1]:
            raise MemoryError("no room for its cache")
        return real_add(self, ids, *a, **k)

    monkeypatch.setattr(engine.BatchDecoder, "add", add)
    with pytest.raises(MemoryError):  # that row's group fails; the scheduler goes on
        sched.submit([Request(ok[1], make_config("ar"), 4)]).result(timeout=60)
    assert sched.submit([Request(ok[0], make_config("ar"), 4)]).result(timeout=60)[0][0]

    def die(self, rows):
        raise Fatal()

    monkeypatch.setattr(engine.BatchDecoder, "_iterate", die)
    with pytest.raises(RuntimeError, match="decoding thread stopped"):
        sched.submit([Request(ok[0], make_config("ar"), 4)]).result(timeout=60)
    with pytest.raises(RuntimeError, match="decoding thread stopped"):
        sched.submit([Request(ok[0], make_config("ar"), 4)])


@pytest.mark.parametrize("error", ["AcceleratorError", "RuntimeError"])
def test_a_device_error_stops_the_thread(close_pair, monkeypatch, error):
    """A CUDA error poisons the process: no fresh decoder, the thread stops and says why (the
    actor then exits and the job replaces it) -- torch 2.8 on raises AcceleratorError, earlier
    versions a RuntimeError."""
    from dynatree import engine

    kind = RuntimeError if error == "RuntimeError" else getattr(torch, error, None)
    if kind is None:
        pytest.skip(f"this torch has no {error}")

    def lost(self, rows):
        raise kind("CUDA error: device-side assert triggered")

    sched = Scheduler(close_pair, 2, threads=1)
    monkeypatch.setattr(engine.BatchDecoder, "_iterate", lost)
    with pytest.raises(RuntimeError, match="decoding thread stopped"):
        sched.submit([Request(random_prompts(1, seed=5)[0], make_config("ar"), 4)]).result(timeout=60)
    assert type(sched.broken) is kind


def test_which_errors_end_the_device():
    from dynatree.scheduler import device_lost

    assert device_lost(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not device_lost(RuntimeError("CUDA error: out of memory"))  # an allocation: the batch halves
    assert not device_lost(RuntimeError("shape mismatch"))  # a row's problem: its rows fail
    assert not device_lost(ValueError("CUDA error: looks like one, but not torch's"))


@pytest.mark.parametrize("batch_size", [4, None])
def test_out_of_device_memory_halves_the_batch(close_pair, monkeypatch, batch_size):
    """A step out of device memory fails its rows (their shards are retried) and the scheduler
    then decodes at most half as many rows, fixed or tuned -- at the same size a retry fails alike."""
    from dynatree import engine

    real = engine.BatchDecoder._iterate

    def tight(self, rows):  # a device that holds two rows
        if len(rows) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, rows)

    monkeypatch.setattr(engine.BatchDecoder, "_iterate", tight)
    sched = Scheduler(close_pair, batch_size, max_batch=4, threads=1)
    prompts = random_prompts(4, seed=6)
    with pytest.raises(torch.OutOfMemoryError):
        sched.submit(_requests(prompts, make_config("ar"), n=4)).result(timeout=60)
    assert sched.batch_size == 2 and sched.broken is None
    assert len(sched.submit(_requests(prompts, make_config("ar"), n=4)).result(timeout=60)) == 4


def test_calls_run_on_the_decoding_thread_between_steps(close_pair, monkeypatch):
    """Scheduler.call: model work beside the batch (the job's divergence check) runs on the
    decoding thread, never concurrently with a step (the runners' scratch buffers are shared)."""
    import threading

    from dynatree import engine

    sched = Scheduler(close_pair, 2, threads=1)
    in_step, seen = threading.Event(), []
    real = engine.BatchDecoder.step

    def step(self):
        in_step.set()
        try:
            return real(self)
        finally:
            in_step.clear()

    monkeypatch.setattr(engine.BatchDecoder, "step", step)
    rows = sched.submit(_requests(random_prompts(2, seed=8), make_config("dynatree"), n=40))

    def probe():
        seen.append((threading.current_thread().name, in_step.is_set()))
        return len(seen)

    assert [sched.call(probe).result(timeout=60) for _ in range(3)] == [1, 2, 3]
    assert seen == [("dynatree-decode", False)] * 3
    with pytest.raises(ZeroDivisionError):
        sched.call(lambda: 1 / 0).result(timeout=60)
    assert all(toks for toks, _, _ in rows.result(timeout=120))  # the batch went on


def test_the_pair_is_loaded_on_the_decoding_thread(close_pair):
    """Scheduler.load: the pair is built where it decodes (libgomp keeps a thread team for every
    thread that ran a parallel region; a second team on 2 cores made each forward 2.5x slower),
    and what the build raises reaches the caller as it is."""
    import threading

    sched, where = Scheduler(None, 2, threads=1), []

    def build():
        where.append(threading.current_thread().name)
        torch.ones(1 << 16).add_(1)  # a parallel torch op, as loading runs
        return close_pair

    assert sched.load(build) is close_pair and where == ["dynatree-decode"]
    out = sched.submit(_requests(random_prompts(1, seed=2), make_config("dynatree"), n=5)).result(timeout=60)
    assert out[0][0] == decode(close_pair, random_prompts(1, seed=2)[0], make_config("ar"), max_new_tokens=5,
                               ignore_eos=True)[0]
    with pytest.raises(FileNotFoundError, match="no model here"):
        Scheduler(None, 1).load(lambda: (_ for _ in ()).throw(FileNotFoundError("no model here")))


def test_the_tuner_tries_the_larger_neighbour_first():
    """After a window at B, the unmeasured larger size comes before the smaller one."""
    t = BatchTuner(max_size=64, start=8, window_s=1.0)
    t.observe(800, 1.0, 8, finished=8)
    assert t.rates == {8: 800.0} and t.size == 16


def test_a_size_is_tried_while_lookahead_times_it_rows_are_left():
    """16 at lookahead 4 needs 64 rows left: exactly 64 is enough, 63 is not (the smaller
    neighbour is tried instead)."""
    for left, then in ((64, 16), (63, 4)):
        t = BatchTuner(max_size=64, start=8, window_s=1.0)
        t.observe(800, 1.0, 8, available=left, finished=8)
        assert t.size == then, left


def test_a_window_whose_rows_outlive_it_ends_at_max_window_s():
    """Long generations: no row finishes within the window, which then ends at max_window_s
    rather than never (the tuner would stay at its first size for the whole job)."""
    t = BatchTuner(max_size=64, start=8, window_s=1.0, max_window_s=5.0)
    for _ in range(9):
        t.observe(400, 0.5, 8, finished=0)
    assert t.rates == {} and t.size == 8
    t.observe(400, 0.5, 8, finished=0)  # 5 s
    assert t.rates == {8: 800.0} and t.size != 8


def test_out_of_device_memory_at_one_row_still_decodes_one_row(close_pair, monkeypatch):
    """Halving one row must leave one row, not none: the retried shard decodes."""
    from dynatree import engine

    real, calls = engine.BatchDecoder._iterate, {"n": 0}

    def once(self, rows):  # out of memory at the first step only
        calls["n"] += 1
        if calls["n"] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, rows)

    monkeypatch.setattr(engine.BatchDecoder, "_iterate", once)
    sched = Scheduler(close_pair, 1, threads=1)
    p = random_prompts(1, seed=7)[0]
    with pytest.raises(torch.OutOfMemoryError):
        sched.submit([Request(p, make_config("ar"), 4)]).result(timeout=60)
    assert sched.batch_size == 1
    out = sched.submit([Request(p, make_config("ar"), 4)]).result(timeout=30)
    assert out[0][0] == decode(close_pair, p, make_config("ar"), max_new_tokens=4)[0]


def test_an_empty_group_resolves_at_once(close_pair):
    """A shard with no rows to decode (every prompt refused before submit) must not wait forever."""
    sched = Scheduler(close_pair, 2, threads=1)
    assert sched.submit([]).result(timeout=10) == []


def test_the_rest_of_a_failed_group_is_not_decoded(close_pair, monkeypatch):
    """Once a row fails its group (its shard is retried whole), the group's queued rows are
    dropped, not decoded for nothing."""
    from dynatree import engine

    sched = Scheduler(close_pair, 1, threads=1)
    bad, *rest = random_prompts(3, seed=9)
    added, real_add = [], engine.BatchDecoder.add

    def add(self, ids, *a, **k):
        added.append(ids)
        if ids == bad:
            raise MemoryError("no room for its cache")
        return real_add(self, ids, *a, **k)

    monkeypatch.setattr(engine.BatchDecoder, "add", add)
    with pytest.raises(MemoryError):
        sched.submit([Request(p, make_config("ar"), 4) for p in (bad, *rest)]).result(timeout=60)
    later = random_prompts(1, seed=10)[0]
    assert sched.submit([Request(later, make_config("ar"), 4)]).result(timeout=60)[0][0]
    assert added == [bad, later]


def test_a_requests_stop_rule_and_again_reach_the_decoder():
    """Request.stop ends the row where ar with the rule ends it; Request.again keeps the prompt in
    the prefix store from its first prefill, so the next sample copies its two whole blocks."""
    from conftest import EOS, tiny_neox
    from dynatree import pair_from_models
    from dynatree.stops import Stop

    pair = pair_from_models(tiny_neox(1), None, None, eos_token_id=EOS)  # (a prefix store of its own)
    prompt = random_prompts(1, seed=11, lo=70, hi=70)[0]
    free = decode(pair, prompt, make_config("ar"), max_new_tokens=8, ignore_eos=True)[0]
    sched = Scheduler(pair, 1, threads=1)
    rule = Stop(token_ids=(free[2],))
    toks, reason, _ = sched.submit([Request(prompt, make_config("ar"), 8, ignore_eos=True, stop=rule)]).result(timeout=60)[0]
    assert reason == "stop" and toks == free[:free.index(free[2]) + 1]
    pair.forget_prefixes()
    samples = [Request(prompt, make_config("ar"), 2, again=k < 2) for k in range(3)]
    assert [m.cached_prompt_tokens for _, _, m in sched.submit(samples).result(timeout=60)] == [0, 64, 64]


def test_the_decoding_thread_takes_the_thread_count_it_is_given(close_pair):
    """threads: OpenMP thread counts are per thread, so the scheduler sets it on its own thread."""
    import threading

    fresh = []
    t = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    t.start()
    t.join()
    want = fresh[0] + 1  # not what a new thread has anyway
    sched = Scheduler(close_pair, 1, threads=want)
    assert sched.call(torch.get_num_threads).result(timeout=60) == want
