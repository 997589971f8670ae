"""Per-generation metrics.

Definitions (per generation; an *iteration* is one draft -> verify -> accept -> commit round):

* ``tokens_per_iteration`` (L-bar): tokens committed by iterations / iterations.  The first
  token comes from the prefill pass and is not counted here.
* A ratio with nothing to divide by is None (null in the Parquet output), not 0: the
  per-iteration ones (``tokens_per_iteration``, ``avg_path_length``, ``mean_tree_size``) for a row
  whose one token came from the prefill (``max_new_tokens`` 1, an EOS or stop first); the
  per-draft ones (``acceptance_rate``, ``accepted_per_node``) for a row that drafted nothing
  (``ar``, or trees the budget kept bare); ``tpot_s`` for a row of fewer than two tokens.  A 0
  there had read as "every drafted token rejected" and pulled means down.
* ``avg_path_length`` (l-bar): mean number of *drafted* tokens accepted per iteration (the
  bonus token excluded), so L-bar = l-bar + 1 except where a stop rule or the token limit
  truncates a commit.
* ``acceptance_rate``: accepted drafted tokens / tree depth, summed over iterations — the
  fraction of the deepest drafted path that was committed.  It never exceeds 1: the paper's
  figures above 100% count the bonus token as accepted; ours does not.
* ``accepted_per_node``: accepted drafted tokens / drafted nodes, how much of the verified tree
  was useful.
* ``mean_tree_size``: drafted nodes per iteration, the root not counted (``ar``: 0; ``linear``
  with k = 5: at most 5).
* ``lookup_tokens``: accepted tokens that came from context lookup (nodes grafted onto the tree,
  lookup.py) rather than from the draft model.
* ``target_forwards`` includes the prefill; with ``kv_update=gather`` it is iterations + 1 (plus
  one per further piece of a prompt longer than a ``kv_window``, prefilled piece by piece).
* ``prefill_time_s``: wall time of the target prefill the prompt took part in (rows that join
  together share one); ``ttft_s`` adds the time the row waited to join a batch.
* ``draft_time_s`` / ``verify_time_s``: wall time inside drafting (draft forwards and tree
  growth) and inside target verification (forward + accept + cache commit); the rest of
  ``wall_time_s`` is prefill and bookkeeping.
* ``forward_time_s``: the row's wall time spent inside model forwards (target and draft, prefill
  included; in a batch every forward while the row was in it, a joining neighbour's prefill too);
  ``overhead_fraction`` = 1 - forward_time_s / wall_time_s is everything else — tree growth,
  masks, top-k transfers, accept, cache commit, Python.  Exact on CPU; on CUDA the forwards are
  asynchronous, so there it counts launch time unless something synchronises.
* ``peak_memory_mb``: on GPU, CUDA's max allocated; on CPU the process's peak RSS -- both
  high-water marks of the process so far (it only grows across calls; ``dynatree bench``
  measures each row's own peak instead).
* ``cached_prompt_tokens``: prompt tokens whose target keys/values were copied from an earlier
  prompt that began the same way (prefix caching, prefix.py) instead of computed.
* ``kv_cache_mb``: the KV cache buffers the generation held at their largest, target and draft
  (preallocated for prompt + new tokens + tree, or for the window with ``kv_window``).
"""
from __future__ import annotations

import functools
import os
import resource
from dataclasses import asdict, dataclass, fields

import pyarrow as pa


@dataclass
class Metrics:
    """One generation's measurements (the module's docstring defines each); also the job output's
    metric columns, in this order (output_schema)."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    new_tokens: int = 0
    wall_time_s: float = 0.0
    tokens_per_s: float = 0.0
    ttft_s: float = 0.0
    tpot_s: float | None = None
    iterations: int = 0
    tokens_per_iteration: float | None = None
    avg_path_length: float | None = None
    acceptance_rate: float | None = None
    accepted_per_node: float | None = None
    mean_tree_size: float | None = None
    lookup_tokens: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    prefill_time_s: float = 0.0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    forward_time_s: float = 0.0
    overhead_fraction: float = 0.0
    peak_memory_mb: float = 0.0
    kv_cache_mb: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Check:
    """A row's comparison with ``ar`` -- greedy, or for a sampled row ``ar`` with the row's seed (the
    job's ``verify_fraction``; check.divergence)."""

    ar_tokens_per_s: float | None = None
    matches_ar: bool | None = None
    first_divergence: int | None = None
    divergence_margin: float | None = None


# The output row: these columns, then every Metrics field, then every Check field.  The job's
# Parquet schema and the worker's rows both come from here (output_schema, result_row).
_HEAD = (("id", pa.string()), ("generated_text", pa.string()), ("generated_token_ids", pa.list_(pa.int32())),
         ("num_generated_tokens", pa.int32()), ("finish_reason", pa.string()), ("method", pa.string()),
         ("error", pa.string()))
_ARROW = {"int": pa.int32(), "float": pa.float64(), "bool": pa.bool_(), "str": pa.string()}


def _arrow_type(annotation: str) -> pa.DataType:
    return _ARROW[annotation.split("|")[0].strip()]


@functools.cache  # built once: result_row asks for its names on every row
def output_schema(sampled: bool = False) -> pa.Schema:
    """``sampled``: a job drawing several samples per prompt (JobSpec.samples) numbers them in a
    ``sample`` column after ``id`` (absent otherwise, so older jobs' shards keep their columns)."""
    head = list(_HEAD)
    if sampled:
        head.insert(1, ("sample", pa.int32()))
    return pa.schema(head + [(f.name, _arrow_type(f.type)) for cls in (Metrics, Check) for f in fields(cls)])


def counted(n: int, one: str, many: str | None = None) -> str:
    """"1 shard", "2 shards", "3 retries" (``many``): a count said as a reader says it."""
    return f"{n} {one if n == 1 else many or one + 's'}"


def result_row(row_id, method: str, error: str | None = None, sample: int | None = None) -> dict:
    """A row with every output column: metrics unset until :func:`fill_row`.  ``sample``: its
    number among the prompt's samples (output_schema(sampled=True)), or None."""
    row = dict.fromkeys(output_schema(sample is not None).names)
    row.update(id=None if row_id is None else str(row_id), method=method, error=error,
               finish_reason="error" if error else None, num_generated_tokens=0)
    if sample is not None:
        row["sample"] = sample
    return row


def fill_row(row: dict, text: str, tokens: list[int], reason: str, m: Metrics) -> None:
    row.update(generated_text=text, generated_token_ids=tokens, num_generated_tokens=len(tokens),
               finish_reason=reason, **m.as_dict())


class Tally:
    """Running sums inside the decoding loop (plain Python numbers; no device syncs)."""

    def __init__(self):
        self.iterations = 0
        self.iter_tokens = 0
        self.accepted = 0
        self.depth_sum = 0
        self.nodes = 0
        self.lookup = 0

    def add(self, committed: int, accepted: int, depth: int, nodes: int, lookup: int = 0) -> None:
        self.iterations += 1
        self.lookup += lookup
        self.iter_tokens += committed
        self.accepted += accepted
        self.depth_sum += depth
        self.nodes += nodes


def defined_mean(values) -> float | None:
    """The mean of the values that are not None (Metrics leaves a ratio with nothing to divide by
    None), or None when there are none."""
    got = [v for v in values if v is not None]
    return sum(got) / len(got) if got else None


def rss_bytes() -> int:
    """This process's resident memory now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def freeze_heap() -> None:
    """Take what loading left on the heap (a pair's modules and tensors, torch's and transformers'
    imports: ~250k objects) out of the garbage collector's sight.  Why: Python's full collection
    walks every tracked object, 135 ms here, and one landing inside a B = 64 batch stalled an
    iteration 10x (bench pair, Zen 5).  For a process that keeps its pair for its life (a job's
    actor, bench, check, profile): frozen objects are still freed by reference counting, but never
    as cyclic garbage, so load_pair leaves it to the caller."""
    import gc

    gc.collect()
    gc.freeze()


def release_freed_memory() -> None:
    """Hand freed memory back to the OS: glibc keeps freed chunks up to its (dynamic, up to 32 MiB)
    mmap threshold in the heap, so freed matrices of a few MiB, or an earlier row's buffers, would
    stay resident (the bench's peaks; a job actor's released weights)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc


def peak_memory_mb(device) -> float:
    if device.type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def finish(tally: Tally, *, prompt_tokens: int, new_tokens: int, wall: float, ttft: float, prefill: float,
           cached_prompt_tokens: int = 0, draft_time: float, verify_time: float, target_forwards: int,
           draft_forwards: int, device, forward_time: float = 0.0, cache_bytes: int = 0) -> Metrics:
    it = tally.iterations
    return Metrics(
        prompt_tokens=prompt_tokens,
        cached_prompt_tokens=cached_prompt_tokens,
        new_tokens=new_tokens,
        wall_time_s=wall,
        tokens_per_s=new_tokens / wall if wall > 0 else 0.0,
        ttft_s=ttft,
        tpot_s=(wall - ttft) / (new_tokens - 1) if new_tokens > 1 else None,
        iterations=it,
        tokens_per_iteration=tally.iter_tokens / it if it else None,
        avg_path_length=tally.accepted / it if it else None,
        acceptance_rate=tally.accepted / tally.depth_sum if tally.depth_sum else None,
        accepted_per_node=tally.accepted / tally.nodes if tally.nodes else None,
        mean_tree_size=tally.nodes / it if it else None,
        lookup_tokens=tally.lookup,
        target_forwards=target_forwards,
        draft_forwards=draft_forwards,
        prefill_time_s=prefill,
        draft_time_s=draft_time,
        verify_time_s=verify_time,
        forward_time_s=forward_time,
        overhead_fraction=1.0 - forward_time / wall if wall > 0 else 0.0,
        peak_memory_mb=peak_memory_mb(device),
        kv_cache_mb=cache_bytes / 2**20,
    )
