"""A shard worker: loads one target/draft pair once and turns prompt rows into result rows.

``ShardWorker`` is a plain class (usable without Ray); ``actors.ray_actor`` wraps it as a
threaded Ray actor.  Each :meth:`ShardWorker.run_shard` call queues its rows on the worker's
:class:`~dynatree.scheduler.Scheduler` and waits: rows of every shard in flight share the
batched decoder, so the batch stays full across shards.  Errors are split in two kinds:

* fatal — the pair cannot be loaded: raised from ``__init__``; the driver fails the job;
* per row — a null, empty or non-string prompt, or one that cannot fit the context: that row
  gets an ``error`` value and the other rows proceed.

Prompt policy: a prompt is tokenized without special tokens and keeps its *last*
``min(max_prompt_tokens, context - max_new_tokens)`` tokens, so every row can generate
``max_new_tokens`` tokens; if the context is not longer than ``max_new_tokens`` the row errors.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import time
import warnings
from pathlib import Path

import torch

from dynatree import budget, sampling
from dynatree.check import divergence, prompt_budget, truncate_prompt
from dynatree.config import SLOW_ON_CPU, ar_reference, within_native_rows
from dynatree.metrics import fill_row, freeze_heap, result_row, rss_bytes
from dynatree.machine import cpu, describe
from dynatree.models import PairError, load_pair
from dynatree.parts import SURROGATE
from dynatree.jobs import footprint
from dynatree.jobs.spec import FAULTS_ENV
from dynatree.scheduler import Request, Scheduler
from dynatree.stops import text_of, texts_changed


def _key(row_id, sample: int) -> str:
    """Sample 0 keeps a 1-sample job's key (so it draws that job's row).  Ids may hold any
    character, so the others' keys are told apart by the character after what precedes them
    (``row_seed``: the seed's digits), never by the id."""
    return f":{row_id}" if sample == 0 else f"/{sample}:{row_id}"


def verify_selected(row_id, fraction: float, sample: int = 0) -> bool:
    """Deterministic choice of output rows for the AR equivalence check (the same on every run)."""
    if fraction >= 1.0:
        return True
    if fraction <= 0.0:
        return False
    key = str(row_id) if sample == 0 else _key(row_id, sample)
    h = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < fraction


def row_seed(seed: int, row_id, sample: int = 0) -> int:
    """A sampled row's seed: fixed by (job seed, row id, sample number), so reruns, resumes and
    any sharding reproduce it, while rows with equal prompts (and a prompt's samples) still draw
    different samples.  64 bits, as the seed option: a 32-bit seed made two of 10,000 rows with one
    prompt draw the very same sample about once in a hundred jobs (100,000 samples: two in three)."""
    return int.from_bytes(hashlib.blake2b(f"{seed}{_key(row_id, sample)}".encode(), digest_size=8).digest(), "little")


def prompt_ids(pair, text, max_new_tokens: int, max_prompt_tokens: int | None, windowed: bool = False,
               chat: bool = False) -> list[int]:
    """The prompt's token ids under the prompt policy; ValueError names what is wrong.  With a
    cache window (kv_window) neither the prompt nor the generation is bound by the context.
    ``chat``: the prompt (a string: one user message; a {role, content} message or a list of them) is
    rendered with the tokenizer's chat template."""
    if text is None:
        raise ValueError("prompt is null")
    if isinstance(text, bytes):  # a binary column: text if it decodes
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("prompt is not UTF-8 text") from None
    keep = prompt_budget(pair.max_context, windowed, max_prompt_tokens, max_new_tokens)
    if chat and isinstance(text, (list, tuple, dict)):  # (a dict: one message)
        ids = pair.encode_chat(text)
    elif not isinstance(text, str):
        hint = "" if chat or not isinstance(text, (list, tuple)) else " (chat messages? run with --chat-template)"
        raise ValueError(f"prompt is not a string ({type(text).__name__})" +
                         (" or a list of {role, content} messages" if chat else hint))
    elif not text.strip():
        raise ValueError("prompt is empty or only whitespace")
    elif SURROGATE.search(text):  # (JSON can escape one; no tokenizer reads it)
        raise ValueError("prompt holds a lone surrogate (a JSON \\ud800-style escape without its pair): "
                         "not Unicode text")
    else:
        ids = pair.encode_chat(text) if chat else pair.encode(text, last=keep)
    if not ids:
        raise ValueError("prompt has no tokens")
    return truncate_prompt(ids, keep, chat)


class ShardWorker:
    def __init__(self, spec, threads: int | None = None, share: float | None = None, driver_warned: bool = True):
        """``share``: bytes of its node's memory this worker may fill (the job driver's estimate,
        jobs/footprint.py), to cap ``--batch-size auto`` once loaded; None: no cap.  ``driver_warned``:
        a job's driver said a slow dtype's warning (config.SLOW_ON_CPU) once for the job; False (a Ray
        Data stage, which has no such driver): this worker says it."""
        self.driver_warned = driver_warned
        _fault_at_start(spec.output)
        self.spec, self.cfg, self.share, self.batch_cap = spec, spec.method_config, share, None
        self.reference_tokens = 0  # (they share the job's batches: the job's tokens/s line names them)
        self.threads = max(1, int(threads)) if threads else torch.get_num_threads()
        self.startup: dict = {}
        self.scheduler = Scheduler(None, None if spec.batch_size == "auto" else int(spec.batch_size),
                                   max_batch=spec.max_batch_size, threads=self.threads)
        # every torch op of the actor runs on the decoding thread, loading included (scheduler.py)
        self.pair = self.scheduler.load(self._load)
        self.stop = spec.stop_rule  # built once, not per row
        if self.stop is not None:
            self.stop.check_vocab(self.pair.id_limit)

    def _load(self):
        spec, t0 = self.spec, time.perf_counter()
        with warnings.catch_warnings():  # the driver said it once for the job, not once per actor
            for said in SLOW_ON_CPU.values() if self.driver_warned else ():
                warnings.filterwarnings("ignore", message=re.escape(said))
            self.pair = load_pair(spec.target, spec.draft, device=spec.device, dtype=spec.dtype,
                                  load_draft=spec.method != "ar", kernel=spec.kernel)
        self.pair.prefix_cache_bytes = int(spec.prefix_cache_gb * 2**30)
        # every forward of the engine runs on the native kernel: each float32 matrix goes once packed
        self.pair.release_packed = within_native_rows(self.cfg)
        if spec.chat_template and not self.pair.has_chat_template:
            raise PairError(f"chat_template is on but the tokenizer of the target ({spec.target or 'the demo pair'}) has none")
        self.startup["load_s"] = time.perf_counter() - t0
        self._warm_up()
        return self.pair

    def _warm_up(self) -> None:
        """First-use costs before the first shard: the kernel build and the budget's profile
        (reported at start-up rather than hidden in the first rows' times)."""
        t0 = time.perf_counter()
        self.pair.runner("target")
        if self.pair.draft is not None:
            self.pair.runner("draft")
        if self.cfg.temperature > 0:  # the sampling noise comes from the C library on every device: a
            sampling.gumbel(0, 1)  # GPU actor builds it here, not on the first row (holding the batch)
        self.startup["kernel_s"] = time.perf_counter() - t0
        problem = self.pair.method_problem(self.cfg)
        if problem:  # every row would fail: fail the actor's start instead, saying why
            raise PairError(problem)
        t0 = time.perf_counter()
        if getattr(self.cfg, "budget_on", False):
            budget.profile(self.pair, kv_dtype=self.cfg.kv_dtype)
        self.startup["profile_s"] = time.perf_counter() - t0
        # (what packing freed, and anything it left)
        self.startup["released_gib"] = self.pair.release_matrices() / 2**30 if self.pair.release_packed else 0.0
        self._cap_batch()
        freeze_heap()  # this actor keeps its pair: full collections need not walk it

    def _cap_batch(self) -> None:
        """auto's batch no larger than the rows whose caches fit in this worker's share of the node
        beside what it holds now, measured (resident memory after loading and releasing)."""
        if self.share is None or self.scheduler.tuner is None:
            return
        configs = [m.config.to_dict() for m in (self.pair.target, self.pair.draft) if m is not None]
        got = footprint.rows_for(self.spec, configs, self.pair.max_context, self.share, rss_bytes())
        if got is not None and got[0] < self.scheduler.tuner.max_size:
            self.batch_cap = max(got[0], 1)
            self.scheduler.cap(self.batch_cap)

    def ready(self) -> dict:
        p = self.pair
        return {"pid": os.getpid(), "device": str(p.device), "dtype": str(p.dtype).replace("torch.", ""),
                "context": p.max_context, "draft_positions": p.draft_positions, "vocab": p.vocab,
                "threads": self.threads, "forward": p.forward_in_use(),
                "draft_forward": p.forward_in_use("draft") if p.draft is not None else None,
                "startup": self.startup, "batch_cap": self.batch_cap,
                # (what a text prompt starts with: the driver pins it in the output's manifest)
                "leading_ids": [] if self.spec.chat_template or p.tokenizer is None else p.leading_ids,
                "texts_changed": texts_changed(p, self.stop)}  # (pinned too: plan.pin_text_rule)

    def stats(self) -> dict:
        s, dev = self.scheduler, self.pair.device
        gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
        return {"batch_size": s.batch_size, "steps": s.steps,
                "rates": dict(s.tuner.rates) if s.tuner is not None else {},
                "machine": describe(cpu()) + (f"; GPU {gpu}" if gpu else ""),  # (what its rates came from)
                "reference_tokens": self.reference_tokens}  # (decoded beside the job's rows, in their batches)

    def _requests(self, rows: list[dict], results: list[dict]) -> tuple[list[Request], list[tuple[str, int]]]:
        spec, reqs, slots, n = self.spec, [], [], self.spec.samples
        for i, r in enumerate(rows):
            problem = r.get("error")  # (a row its caller refused: the Ray Data stage's null or repeated id)
            if problem is None:
                try:
                    ids = prompt_ids(self.pair, r["text"], spec.max_new_tokens, spec.max_prompt_tokens,
                                     bool(self.cfg.kv_window), spec.chat_template)
                except ValueError as e:
                    problem = str(e)
            if problem is not None:
                for out in results[i * n:(i + 1) * n]:
                    out.update(error=problem, finish_reason="error")
                continue
            # a prompt's samples queue together: they join one prefill, which computes the prompt once
            for k in range(n):
                j, cfg = i * n + k, self.cfg
                if cfg.temperature > 0:
                    cfg = dataclasses.replace(cfg, seed=row_seed(cfg.seed, r["id"], k))
                # the ar reference (a sample: with the row's seed) decodes in the same batches; it
                # is not announced to prefix caching, so it computes the prompt as its row did, not
                # from the row's copy (which had made `ar` look 2-4x faster: speedup vs ar 0.27
                # against 0.83 with caching off, batch 1)
                checked = verify_selected(r["id"], spec.verify_fraction, k)
                reqs.append(Request(ids, cfg, spec.max_new_tokens, spec.ignore_eos, self.stop, k < n - 1))
                slots.append(("gen", j))
                if checked:
                    reqs.append(Request(ids, ar_reference(cfg), spec.max_new_tokens, spec.ignore_eos, self.stop,
                                        k < n - 1))
                    slots.append(("ref", j))
        return reqs, slots

    def run_shard(self, shard: str, rows: list[dict], backlog: int = 0) -> list[dict]:
        """rows: [{"id": ..., "text": ...}] -> ``spec.samples`` result rows per input row, in order
        (a row's samples together, numbered in ``sample`` when there are several).  ``backlog``:
        the input rows the job has still to send this actor (the batch tuner's horizon)."""
        _fault_on_shard(shard, self.spec.output)
        self.scheduler.tell_backlog(backlog * self.spec.samples)
        n = self.spec.samples
        results = [result_row(r["id"], self.spec.method, sample=k if n > 1 else None) for r in rows for k in range(n)]
        reqs, slots = self._requests(rows, results)
        outcomes = self.scheduler.submit(reqs).result()
        refs = {}
        for (kind, i), (req, got) in zip(slots, zip(reqs, outcomes)):
            if isinstance(got, Exception):
                if kind == "gen":
                    results[i].update(error=str(got), finish_reason="error")
            elif kind == "gen":
                fill_row(results[i], text_of(self.pair.decoder(req.ids), got[0], got[1], self.stop), *got)
            else:
                refs[i] = (req.cfg, req.ids, got)
                self.reference_tokens += len(got[0])
        checked = {i: ref for i, ref in refs.items() if results[i]["error"] is None}

        def check():  # runs the target: on the decoding thread (Scheduler.call), not beside it
            return {i: divergence(self.pair, ids, ref, results[i]["generated_token_ids"], cfg)
                    for i, (cfg, ids, (ref, _, _)) in checked.items()}

        # a row and its reference time the same shared forwards at batch size > 1: no speed comparison
        alone = self.scheduler.batch_size == 1
        for i, (idx, margin) in (self.scheduler.call(check).result() if checked else {}).items():
            results[i].update(matches_ar=idx is None, first_divergence=idx, divergence_margin=margin,
                              ar_tokens_per_s=checked[i][2][2].tokens_per_s if alone else None)
        return results


def _faults() -> dict:
    """Test-only fault injection (``DYNATREE_FAULT_INJECTION``, JSON): the process exits as an
    OOM kill or a lost node would end it, or stalls as a stuck one would."""
    return json.loads(os.environ.get(FAULTS_ENV) or "{}")


def _fault_at_start(output: str) -> None:
    """A replacement actor that never gets ready (its node lost, no room for it), or that cannot
    load (its model files damaged since the job began)."""
    if _faults().get("never_ready_after_death") and list(Path(output).glob(".fault-*")):
        time.sleep(3600)
    if _faults().get("fail_load_after_death") and list(Path(output).glob(".fault-*")):
        raise PairError("cannot load model 'target': incomplete metadata, file not fully covered (injected)")


def _fault_on_shard(shard: str, output: str) -> None:
    faults = _faults()
    if faults.get("stall_on_shard") == shard:  # a slow or stuck actor (seconds)
        time.sleep(faults.get("stall_s", 5.0))
    if faults.get("die_always_on_shard") == shard:
        os._exit(1)
    if faults.get("die_once_on_shard") == shard:
        marker = Path(output) / f".fault-{shard}"
        if not marker.exists():
            marker.write_text(str(os.getpid()))
            os._exit(1)
