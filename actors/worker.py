"""A shard worker: loads one target/draft pair once and turns prompt rows into result rows.

``ShardWorker`` is a plain class (usable without Ray); ``actors.ray_actor`` wraps it as a Ray
actor.  Errors are split in two kinds:

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
import os
import zlib
from pathlib import Path

import torch

from dynatree.batched import decode_ar_batch
from dynatree.check import divergence
from dynatree.config import ARConfig, make_config
from dynatree.engine import decode
from dynatree.models import load_pair


def verify_selected(row_id, fraction: float) -> bool:
    """Deterministic sample of ids for the AR equivalence check (same ids on every run)."""
    if fraction >= 1.0:
        return True
    if fraction <= 0.0:
        return False
    h = int(hashlib.sha256(str(row_id).encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < fraction


def row_seed(seed: int, row_id) -> int:
    """A sampled row's seed: fixed by (job seed, row id), so reruns, resumes and any sharding
    reproduce it, while rows with equal prompts still draw different samples."""
    return zlib.crc32(f"{seed}:{row_id}".encode())


def empty_result(row_id, method: str, error: str | None = None) -> dict:
    return {"id": str(row_id), "prompt_tokens": 0, "generated_text": None, "generated_token_ids": None,
            "num_generated_tokens": 0, "finish_reason": "error" if error else None, "method": method,
            "error": error, "tokens_per_s": None, "wall_time_s": None, "ttft_s": None, "tpot_s": None,
            "iterations": None, "tokens_per_iteration": None, "avg_path_length": None,
            "acceptance_rate": None, "draft_time_s": None, "verify_time_s": None,
            "target_forwards": None, "draft_forwards": None, "lookup_tokens": None, "ar_tokens_per_s": None,
            "matches_ar": None, "first_divergence": None, "divergence_margin": None}


class ShardWorker:
    def __init__(self, job: dict, threads: int | None = None):
        if threads:
            torch.set_num_threads(max(1, int(threads)))
        self.job = job
        self.cfg = make_config(job["method"], job.get("options") or {})
        self.pair = load_pair(job.get("target"), job.get("draft"), device=job.get("device", "auto"),
                              dtype=job.get("dtype", "float32"), load_draft=job["method"] != "ar")
        self.shards_done = 0

    def ready(self) -> dict:
        p = self.pair
        return {"pid": os.getpid(), "device": str(p.device), "dtype": str(p.dtype).replace("torch.", ""),
                "context": p.max_context, "vocab": p.vocab, "threads": torch.get_num_threads()}

    def _prompt_ids(self, text) -> list[int]:
        if text is None:
            raise ValueError("prompt is null")
        if not isinstance(text, str):
            raise ValueError(f"prompt is not a string ({type(text).__name__})")
        if not text.strip():
            raise ValueError("prompt is empty")
        ids = self.pair.encode(text)
        if not ids:
            raise ValueError("prompt has no tokens")
        room = self.pair.max_context - self.job["max_new_tokens"]
        if room < 1:
            raise ValueError(f"max_new_tokens={self.job['max_new_tokens']} does not fit the "
                             f"{self.pair.max_context}-token context")
        limit = min(room, self.job.get("max_prompt_tokens") or room)
        return ids[-limit:]

    def _fill(self, out: dict, ids: list[int], toks: list[int], reason: str, m) -> None:
        out.update({
            "prompt_tokens": len(ids), "generated_text": self.pair.decode(toks),
            "generated_token_ids": toks, "num_generated_tokens": len(toks), "finish_reason": reason,
            "tokens_per_s": m.tokens_per_s, "wall_time_s": m.wall_time_s, "ttft_s": m.ttft_s,
            "tpot_s": m.tpot_s, "iterations": m.iterations,
            "tokens_per_iteration": m.tokens_per_iteration, "avg_path_length": m.avg_path_length,
            "acceptance_rate": m.acceptance_rate, "draft_time_s": m.draft_time_s,
            "verify_time_s": m.verify_time_s, "target_forwards": m.target_forwards,
            "draft_forwards": m.draft_forwards, "lookup_tokens": m.lookup_tokens})

    def _maybe_die(self, shard: str) -> None:
        fi = self.job.get("fault_injection") or {}
        if fi.get("die_always_on_shard") == shard:
            os._exit(1)
        if fi.get("die_once_on_shard") == shard:
            marker = Path(self.job["output"]) / f".fault-{shard}"
            if not marker.exists():
                marker.write_text(str(os.getpid()))
                os._exit(1)  # simulate a crashed worker process (OOM kill, node loss)

    def run_shard(self, shard: str, rows: list[dict]) -> list[dict]:
        """rows: [{"id": ..., "text": ...}] -> one result row per input row, same order."""
        job, method = self.job, self.job["method"]
        self._maybe_die(shard)
        results, todo = [], []
        for r in rows:
            out = empty_result(r["id"], method)
            try:
                todo.append((out, self._prompt_ids(r["text"])))
            except ValueError as e:
                out.update(error=str(e), finish_reason="error")
            results.append(out)
        n_new, ignore = job["max_new_tokens"], bool(job.get("ignore_eos"))
        bs = int(job.get("batch_size") or 1)
        if method == "ar" and bs > 1:
            for i in range(0, len(todo), bs):
                chunk = todo[i:i + bs]
                for (out, ids), (toks, reason, m) in zip(chunk, decode_ar_batch(
                        self.pair, [ids for _, ids in chunk], max_new_tokens=n_new, ignore_eos=ignore)):
                    self._fill(out, ids, toks, reason, m)
        else:
            for out, ids in todo:
                cfg = self.cfg
                if cfg.temperature > 0:
                    cfg = dataclasses.replace(cfg, seed=row_seed(cfg.seed, out["id"]))
                try:
                    toks, reason, m = decode(self.pair, ids, cfg, max_new_tokens=n_new, ignore_eos=ignore)
                except ValueError as e:
                    out.update(error=str(e), finish_reason="error")
                    continue
                self._fill(out, ids, toks, reason, m)
        sampled = self.cfg.temperature > 0  # a sample is not comparable with greedy ar
        for out, ids in todo:
            if out["error"] is None and not sampled and verify_selected(out["id"], job.get("verify_fraction", 0.0)):
                ref, _, mref = decode(self.pair, ids, ARConfig(), max_new_tokens=n_new, ignore_eos=ignore)
                idx, margin = divergence(self.pair, ids, ref, out["generated_token_ids"])
                out.update(matches_ar=idx is None, first_divergence=idx, divergence_margin=margin,
                           ar_tokens_per_s=mref.tokens_per_s)
        self.shards_done += 1
        return results
