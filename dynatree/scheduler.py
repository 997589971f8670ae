"""Continuous batching: one thread keeps a BatchDecoder full from a queue of requests.

Callers (the job worker: one call per shard, several shards in flight) :meth:`Scheduler.submit`
a group of requests and wait on its Future.  Rows of every waiting group share the decoder, so
batches stay full across shard boundaries: when a row finishes, the next queued request joins
at the following step.  The number of rows in flight, B, is fixed or chosen online by
:class:`BatchTuner` from measured committed tokens per second.

Anything else that runs the models while rows are in flight (the job's divergence check) goes
through :meth:`Scheduler.call`, which runs it on the decoding thread between steps: the runners
are not thread-safe (the native kernel's scratch buffers are per runner), and the decoding
thread carries the job's thread count.  Loading the pair goes there too (:meth:`Scheduler.load`):
OpenMP (libgomp) keeps a team of threads for every thread that ever ran a parallel region, and
once the teams outnumber the cores it stops spinning at barriers and sleeps instead -- a torch op
on the loading thread made every forward on the decoding thread 1.5 ms slower (2.5x at one token
on 2 cores; the job ran at half the speed of the same decoding on one thread).

A request that cannot be decoded (its prompt does not fit the context) resolves to the
ValueError instead of a result.  An unexpected error inside a step fails the groups that had
rows in the decoder (their callers see the exception; the job retries their shards) and the
scheduler goes on with a fresh decoder -- unless the device itself is lost (a CUDA error), when
the thread stops and ``broken`` says why.
"""
from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from .engine import BatchDecoder
from .models import ModelPair
from .stops import Stop

LADDER = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# A CUDA error (a device-side assert, an illegal address) poisons the process's context: every
# later call fails too, so a fresh decoder cannot help -- the thread ends (``broken``) and the job
# replaces the actor.  An out-of-memory error is not one of these: its shard fails, the rest go on.
_DEVICE_LOST = tuple(c for c in (getattr(torch, "AcceleratorError", None),) if c is not None)
_OUT_OF_MEMORY = tuple(c for c in (getattr(torch, "OutOfMemoryError", None),) if c is not None)


def device_lost(e: BaseException) -> bool:
    """A CUDA error that ends the process's use of the device: torch 2.8 on raises AcceleratorError,
    earlier versions a plain RuntimeError whose message begins so (an allocation failure aside)."""
    if isinstance(e, _DEVICE_LOST):
        return True
    text = str(e)
    return (type(e) is RuntimeError and text.startswith("CUDA error") and "out of memory" not in text
            and not isinstance(e, _OUT_OF_MEMORY))


@dataclass(frozen=True)
class Request:
    ids: list[int]
    cfg: object
    max_new_tokens: int
    ignore_eos: bool = False
    stop: Stop | None = None
    again: bool = False  # more rows with this prompt follow (BatchDecoder.add)


@dataclass
class BatchTuner:
    """Picks B (rows in flight) by hill-climbing measured throughput on :data:`LADDER`.

    A size is measured over a window of steps taken with exactly B rows in flight (steps with
    fewer -- the queue ran dry -- or more -- rows left over from a larger size -- say nothing
    about B) that lasts at least ``window_s`` seconds *and* sees at least B rows finish: a whole
    turnover of the batch, so every window carries its share of the joiners' prefill.  (Windows
    of time alone were biased: rows that start together finish together -- same length, EOS
    ignored -- and B prompts' prefill then lands in one step that a window holds once, twice or
    not at all; on a fast host, whole jobs settled on B = 8 at 0.81x the throughput of B = 16.)
    ``max_window_s`` ends a window whose rows outlive it (long generations, where prefill is a
    small share anyway).  The best size is the smallest whose rate no larger size beats by
    ``gain``; its unmeasured neighbours are tried (larger first); once both are measured the
    best is kept, and every ``recheck`` windows one neighbour is measured again, because the rate
    moves with prompt lengths and acceptance.

    A size is tried only while the rows left (``available``: in flight, queued and the caller's
    backlog) number ``lookahead`` times it: a window at a worse size is paid for by the rows
    decoded at a better one afterwards, and a short job has none -- trying 32 and 64 in a
    64-prompt job cost it up to 40% against staying at 16.  A smaller size needs fewer: its window
    is short and cheap, and where the rows' caches outgrow the L3 it can be much faster (README,
    the Emerald Rapids host: a 64-prompt job had never left 16).
    """

    max_size: int = 64
    start: int = 16
    window_s: float = 2.0
    max_window_s: float = 30.0
    gain: float = 1.05
    recheck: int = 8
    lookahead: int = 4
    rates: dict = field(default_factory=dict)  # size -> tokens/s (last window)
    size: int = 0
    _tokens: int = 0
    _seconds: float = 0.0
    _finished: int = 0
    _windows: int = 0
    available: int | None = None

    def __post_init__(self):
        # the ladder's sizes below the largest allowed, then it (a memory cap of 7 allows 7, not 4)
        self.sizes = [b for b in LADDER if b < self.max_size] + [max(self.max_size, 1)]
        self.size = max(b for b in self.sizes if b <= max(self.start, 1))

    def observe(self, tokens: int, seconds: float, rows: int, available: int | None = None,
                finished: int = 0) -> None:
        """One step: tokens committed, its seconds, the rows it decoded, how many rows there are
        left to decode (in flight, queued and still to come) and how many finished."""
        self.available = available
        if rows != self.size:
            return
        self._tokens += tokens
        self._seconds += seconds
        self._finished += finished
        if (self._seconds >= self.window_s and self._finished >= self.size) or self._seconds >= self.max_window_s:
            self.rates[self.size] = self._tokens / self._seconds
            self._windows += 1
            self._move(self._next())

    def best(self) -> int:
        best = None
        for b in sorted(self.rates):
            if best is None or self.rates[b] > self.gain * self.rates[best]:
                best = b
        return best if best is not None else self.size

    def _next(self) -> int:
        best = self.best()
        i = self.sizes.index(best)
        left = self.available

        def worth(b: int) -> bool:  # rows to fill it, and to profit from what its window shows
            return left is None or left >= self.lookahead * b

        near = [self.sizes[j] for j in (i + 1, i - 1) if 0 <= j < len(self.sizes) and worth(self.sizes[j])]
        unmeasured = [b for b in near if b not in self.rates]
        if unmeasured:
            return unmeasured[0]
        if near and self._windows % self.recheck == 0:
            return near[(self._windows // self.recheck) % len(near)]
        return best

    def _move(self, size: int) -> None:
        self.size, self._tokens, self._seconds, self._finished = size, 0, 0.0, 0


class _Group:
    def __init__(self, n: int):
        self.future: Future = Future()
        self.results: list = [None] * n
        self.left = n

    def resolve(self, i: int, value) -> None:
        self.results[i] = value
        self.left -= 1
        if self.left == 0 and not self.future.done():
            self.future.set_result(self.results)

    def fail(self, err: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(err)


def _fail_rows(dec: BatchDecoder, e: BaseException) -> None:
    """Every row of ``dec`` fails with ``e`` (their shards are retried); the rows are not kept."""
    for r in dec.joining + dec.active:
        r.key[0].fail(e)


class Scheduler:
    """Decodes submitted requests in shared batches on a background thread.

    ``batch_size``: rows in flight, or None to tune it (:class:`BatchTuner`, up to ``max_batch``).
    ``threads``: the torch/OpenMP thread count of the decoding thread (thread counts are per
    thread in OpenMP, so the caller's setting does not reach a new thread by itself).
    """

    def __init__(self, pair: ModelPair | None, batch_size: int | None = None, *, max_batch: int = 64,
                 threads: int | None = None):
        self.pair, self.fixed, self.threads = pair, batch_size, threads
        self.tuner = BatchTuner(max_size=max_batch, start=min(16, max_batch)) if batch_size is None else None
        self._queue: deque = deque()  # (group, index, Request)
        self._calls: deque = deque()  # (fn, Future): run between steps (call)
        self._dec: BatchDecoder | None = None
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self.broken: BaseException | None = None  # why the decoding thread ended, if it did
        self.steps = 0
        self.backlog: int | None = None  # rows the caller will submit later (tell_backlog): the tuner's horizon

    @property
    def batch_size(self) -> int:
        return self.fixed if self.tuner is None else self.tuner.size

    def cap(self, rows: int) -> None:
        """Tune no higher than ``rows`` (what memory holds: actors/worker.py), before decoding starts."""
        if self.tuner is not None and rows < self.tuner.max_size:
            self.tuner = BatchTuner(max_size=max(rows, 1), start=min(16, max(rows, 1)))

    def _out_of_memory(self, rows: int) -> None:
        """A step (or a row's cache) with ``rows`` rows ran out of device memory: its rows fail and
        their shards are retried, which at the same batch size would fail alike -- so decode at most
        half as many rows from now on (the caller frees torch's cached blocks once the rows are gone)."""
        limit = max(rows // 2, 1)
        if self.tuner is not None:
            self.cap(min(limit, self.tuner.max_size))
        else:
            self.fixed = min(self.fixed, limit)
        print(f"out of device memory at {rows} rows: decoding at most {self.batch_size} from now on",
              file=sys.stderr, flush=True)

    def submit(self, requests: list[Request]) -> Future:
        """Queue requests; the Future gives one (tokens, finish reason, Metrics) — or the
        ValueError that rejected it — per request, in order."""
        group = _Group(len(requests))
        if not requests:
            group.future.set_result([])
            return group.future
        self._enqueue(self._queue, [(group, i, r) for i, r in enumerate(requests)])
        return group.future

    def tell_backlog(self, rows: int) -> None:
        """The caller has ``rows`` more to submit (the tuner explores only while enough are left).
        A job's backlog only shrinks, but its calls arrive in any order (a thread each): the
        smallest told holds."""
        with self._cond:
            self.backlog = rows if self.backlog is None else min(self.backlog, rows)

    def call(self, fn) -> Future:
        """Run ``fn()`` on the decoding thread before its next step; the Future gives its result
        (or its exception).  For work that runs the models beside the batch (see the module)."""
        future: Future = Future()
        self._enqueue(self._calls, [(fn, future)])
        return future

    def load(self, build) -> ModelPair:
        """Build the pair with ``build()`` on the decoding thread (see the module: every torch op
        of the process on one thread) and decode with it; returns it, or raises what build did."""
        self.pair = self.call(build).result()
        return self.pair

    def _enqueue(self, queue: deque, items: list) -> None:
        with self._cond:
            if self.broken is not None:
                raise RuntimeError(f"the decoding thread stopped: {self.broken!r}")
            queue.extend(items)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dynatree-decode", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run_calls(self) -> None:
        with self._cond:  # emptied in place: callers hold a reference to this deque (_enqueue)
            calls = list(self._calls)
            self._calls.clear()
        for fn, future in calls:
            try:
                future.set_result(fn())
            except Exception as e:  # noqa: BLE001 - the caller gets it
                future.set_exception(e)

    def _wait(self, busy: bool) -> None:
        with self._cond:
            while not busy and not self._queue and not self._calls:
                self._cond.wait()

    def _fill(self, dec: BatchDecoder) -> None:
        with self._cond:
            while self._queue and len(dec) < self.batch_size:
                group, i, r = self._queue.popleft()
                if group.future.done():  # its shard already failed: don't decode the rest
                    continue
                try:
                    dec.add(r.ids, r.cfg, max_new_tokens=r.max_new_tokens, ignore_eos=r.ignore_eos,
                            stop=r.stop, key=(group, i), again=r.again)
                except ValueError as e:  # this row only
                    group.resolve(i, e)
                except Exception as e:  # noqa: BLE001 - e.g. out of memory for its cache: its shard fails
                    oom = isinstance(e, _OUT_OF_MEMORY)
                    if oom:
                        self._out_of_memory(len(dec) + 1)
                        e.with_traceback(None)
                    group.fail(e)
                    if oom and torch.cuda.is_available():
                        torch.cuda.empty_cache()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # the thread is ending: no caller may wait for it forever
            with self._cond:
                self.broken = e
                err = RuntimeError(f"the decoding thread stopped: {e!r}")
                for group, _, _ in self._queue:
                    group.fail(err)
                for _, future in self._calls:
                    future.set_exception(err)
                self._queue.clear()
                self._calls.clear()
                for r in (self._dec.joining + self._dec.active) if self._dec is not None else ():
                    r.key[0].fail(err)
            traceback.print_exc()  # the callers have the reason; the log gets the stack

    def _loop(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)
        dec = None  # made for the first request: a call may load the pair first (load)
        while True:
            self._wait(dec is not None and len(dec) > 0)
            self._run_calls()
            if dec is None:
                if not self._queue:
                    continue
                dec = self._dec = BatchDecoder(self.pair)
            self._fill(dec)
            if not len(dec):
                continue
            rows, tokens, t0 = len(dec), dec.tokens, time.perf_counter()
            try:
                finished = dec.step()
            except Exception as e:  # noqa: BLE001 - the rows' callers get it; the thread lives on
                if device_lost(e):
                    raise  # the device cannot run anything more in this process: end the thread
                oom = isinstance(e, _OUT_OF_MEMORY)
                if oom:  # smaller batches before the rows' retries can come; the traceback's frames
                    self._out_of_memory(rows)  # hold the step's tensors (the callers get the message)
                    e.with_traceback(None)
                _fail_rows(dec, e)
                dec = self._dec = BatchDecoder(self.pair)
                if oom and torch.cuda.is_available():  # the failed batch gone: its blocks free too
                    torch.cuda.empty_cache()
                continue
            self.steps += 1
            if self.tuner is not None:
                self.tuner.observe(dec.tokens - tokens, time.perf_counter() - t0, rows,
                                   len(dec) + len(self._queue) + (self.backlog or 0), len(finished))
            for (group, i), toks, reason, m in finished:
                group.resolve(i, (toks, reason, m))
