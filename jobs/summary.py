"""Job summary: computed from the shard files alone (so a resumed job summarizes every row)."""
from __future__ import annotations

import json
import os
import math
import re
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dynatree.config import ar_reference, reference_label
from dynatree.machine import replaced, versions
from dynatree.metrics import counted

from .runs import RUNS, read as read_runs, this_run


def _config(spec) -> dict:
    """The job's fields, its output named in full (a reader elsewhere finds the shards) and its
    models where they are."""
    d = spec.to_dict()
    if d.get("output"):
        d["output"] = os.path.abspath(d["output"])
    if d.get("target") is None:  # the bundled demo pair, by where it is (it read null: trial AJ)
        from dynatree.names import default_pair_dir

        d["target"] = str(default_pair_dir() / "target")
        d["draft"] = str(default_pair_dir() / "draft") if d.get("method") != "ar" else None
    return d


class _Moments:
    """Mean and sample standard deviation merged shard by shard without keeping the values
    (corpora are large): Chan et al.'s pairwise update, which does not cancel as a sum of squares
    minus n * mean^2 does."""

    def __init__(self):
        self.n, self.mean, self.m2 = 0, 0.0, 0.0

    def merge(self, n: int, mean: float, m2: float) -> None:
        """Add a part of n values with this mean and sum of squared deviations (_moments_of)."""
        if not n:
            return
        delta, total = mean - self.mean, self.n + n
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.n * n / total
        self.n = total

    def as_dict(self) -> dict:
        if not self.n:
            return {"mean": None, "std": None, "n": 0}
        var = max(self.m2, 0.0) / (self.n - 1) if self.n > 1 else 0.0
        return {"mean": self.mean, "std": math.sqrt(var), "n": self.n}


def _moments_of(values) -> list:
    """[n, mean, sum of squared deviations] of the non-null values."""
    values = pc.drop_null(values)
    n = len(values)
    if not n:
        return [0, 0.0, 0.0]
    return [n, pc.mean(values).as_py(), pc.variance(values, ddof=0).as_py() * n]


_COLUMNS = ["id", "sample", "error", "num_generated_tokens", "finish_reason", "tokens_per_s", "tokens_per_iteration",
            "acceptance_rate", "lookup_tokens", "ttft_s", "tpot_s", "ar_tokens_per_s", "matches_ar",
            "first_divergence", "divergence_margin", "prompt_tokens", "cached_prompt_tokens", "iterations"]
_MOMENTS = ("tokens_per_s", "tokens_per_iteration", "acceptance_rate", "ttft_s", "tpot_s")
_PER_ITERATION = ("tokens_per_iteration", "acceptance_rate")
_SUMS = {"tokens": "num_generated_tokens", "lookup": "lookup_tokens", "prompt": "prompt_tokens",
         "cached": "cached_prompt_tokens"}


OTHER_ERRORS = "(other kinds: see the error column)"
_KINDS_KEPT = 1000  # kinds counted one by one (a corpus's kinds are few; this bounds the driver's memory)


def error_kind(message: str) -> str:
    """A row's error message with its numbers written N: one kind for the rows that failed alike
    ("chat prompt of 610 tokens ..." and "... of 617 tokens ..." had counted as two)."""
    return re.sub(r"\d+", "N", message)


def _error_messages(t: dict) -> dict:
    """The ten commonest kinds of error, each under its first message, then the rest together:
    counts that sum to the errors."""
    top = t["error_kinds"].most_common(10)
    rest = t["other_errors"] + sum(t["error_kinds"].values()) - sum(n for _, n in top)
    return {**{t["error_example"][k]: n for k, n in top}, **({OTHER_ERRORS: rest} if rest else {})}


def every_row_failed(summary: dict) -> str | None:
    """What a job whose every row failed ends with (the command exits 1 and the run's record says
    "failed" -- it said "complete": trial AJ), or None."""
    if not summary["rows"] or summary["errors"] != summary["rows"]:
        return None
    kind, n = next(iter(summary["error_messages"].items()))
    return (f"every row failed ({summary['errors']}); the most common error, on {counted(n, 'row')}: {kind!r}"
            + (f" {OTHER_ERRORS}" if n < summary["errors"] else ""))


def shard_files(out: Path) -> list[Path]:
    return sorted((Path(out) / "shards").glob("part-*.parquet"))


def read_rows(out: Path) -> list[dict]:
    """Every output row (tests and small jobs; a corpus is read with pyarrow.dataset)."""
    rows: list[dict] = []
    for f in shard_files(out):
        rows.extend(pq.read_table(f).to_pylist())
    return rows


def _counts(values: pa.ChunkedArray) -> list[tuple]:
    """(value, count) of the non-null values, in order of first appearance."""
    return [(v["values"], v["counts"]) for v in pc.value_counts(pc.drop_null(values)).to_pylist()]


def _total(table: pa.Table, name: str) -> int:
    return (pc.sum(table[name]).as_py() or 0) if name in table.column_names else 0


TALLY_VERSION = 2  # of shard_tally's record: a shard holding another is tallied from its columns


def shard_tally(table: pa.Table, sampled: bool) -> dict:
    """One shard's part of the summary, JSON-able: the shard writer keeps it in the file's footer
    (plan.write_shard), so a summary reads each shard's footer, not its columns -- 0.24 against
    3.5 ms a shard (10,000 shards: 35 s of silence at each run's end, 2026-11-29).  A 1-sample
    job's "sample" is an input column (not tallied); an older version's shard may lack newer columns."""
    table = table.select([c for c in _COLUMNS if c in table.column_names and (sampled or c != "sample")])
    have = set(table.column_names)
    failed = pc.is_valid(table["error"])
    ok = table.filter(pc.invert(failed))
    iterated = ok.filter(pc.fill_null(pc.greater(ok["iterations"], 0), False)) if "iterations" in have else ok
    checked = ok.filter(pc.is_valid(ok["matches_ar"]))
    timed = checked.filter(pc.and_(pc.fill_null(pc.not_equal(checked["ar_tokens_per_s"], 0), False),
                                   pc.fill_null(pc.not_equal(checked["tokens_per_s"], 0), False)))
    wrong = checked.filter(pc.invert(checked["matches_ar"]))
    keep = [c for c in ("id", "sample", "first_divergence", "divergence_margin") if c in wrong.column_names]
    return {"version": TALLY_VERSION, "sampled": sampled, "rows": table.num_rows,
            "errors": pc.sum(failed).as_py() or 0, **_error_kinds(_counts(table["error"])),
            "reasons": [(r, n) for r, n in _counts(table["finish_reason"]) if r],
            "sums": {key: _total(ok, name) for key, name in _SUMS.items()},
            # null where undefined (metrics.Metrics); shards written before 2026-11-28 hold 0.0 for a
            # row with no iteration
            "moments": {k: _moments_of((iterated if k in _PER_ITERATION else ok)[k]) for k in _MOMENTS},
            "speedup": _moments_of(pc.divide(timed["tokens_per_s"], timed["ar_tokens_per_s"])),
            "checked": checked.num_rows, "mismatches": wrong.num_rows,
            "mismatched": wrong.select(keep).slice(0, 50).to_pylist()}


def _error_kinds(counts: list[tuple]) -> dict:
    """A shard's error counts by kind (error_kind), each with its first message, at most
    _KINDS_KEPT kinds and the rest as a count: the footer's size stays bounded whatever the rows'
    messages (one per row, numbers in them, made a 100,000-row shard's footer 20 MB)."""
    kinds: dict[str, list] = {}
    other = 0
    for message, n in counts:
        kind = error_kind(message)
        if kind in kinds or len(kinds) < _KINDS_KEPT:
            kinds.setdefault(kind, [kind, 0, message])[1] += n
        else:
            other += n
    return {"error_kinds": list(kinds.values()), "other_errors": other}


def _stored_tally(schema: pa.Schema, sampled: bool) -> dict | None:
    """The shard's footer record of shard_tally (``schema``: the shard's), or None (a shard of an
    older version)."""
    meta = schema.metadata or {}
    try:
        part = json.loads(meta.get(b"dynatree", b"{}")).get("tally")
    except (ValueError, AttributeError):
        return None
    ok = isinstance(part, dict) and part.get("version") == TALLY_VERSION and part.get("sampled") == sampled
    return part if ok else None


def _tally(out: Path, sampled: bool = False) -> dict:
    t = {"rows": 0, "errors": 0, "checked": 0, "mismatched": [], "mismatches": 0, "reasons": Counter(),
         "error_kinds": Counter(), "error_example": {}, "other_errors": 0, "speedup": _Moments(),
         **dict.fromkeys(_SUMS, 0), **{k: _Moments() for k in _MOMENTS}}
    for f in shard_files(out):  # one shard at a time: memory stays flat
        try:
            schema = pq.read_schema(f)  # (the footer only)
            part = _stored_tally(schema, sampled)
            if part is None:
                part = shard_tally(pq.read_table(f, columns=[c for c in _COLUMNS if c in schema.names]), sampled)
        except (OSError, pa.ArrowException) as e:  # (pyarrow's bare "magic bytes not found": trial AK)
            raise ShardUnreadable(f"{f} cannot be read ({e})") from e
        _merge(t, part)
    return t


class ShardUnreadable(Exception):
    """A shard file written by the job that cannot be read when it is summarized (damaged since)."""


def _merge(t: dict, part: dict) -> None:
    """Add one shard's shard_tally to the job's tally ``t``."""
    for key in ("rows", "errors", "checked", "mismatches"):
        t[key] += part[key]
    t["reasons"].update(dict(part["reasons"]))
    t["other_errors"] += part["other_errors"]
    for kind, n, message in part["error_kinds"]:
        if kind in t["error_kinds"] or len(t["error_kinds"]) < _KINDS_KEPT:
            t["error_kinds"][kind] += n
            t["error_example"].setdefault(kind, message)
        else:
            t["other_errors"] += n
    for key, n in part["sums"].items():
        t[key] += n
    for k, moments in part["moments"].items():
        t[k].merge(*moments)
    t["speedup"].merge(*part["speedup"])
    t["mismatched"].extend(part["mismatched"][:50 - len(t["mismatched"])])


def previous_decoding_run(out: Path) -> dict | None:
    """The record ("this_run", "startup" and "versions") of the last run of the job in ``out`` that
    decoded rows -- from its run records (jobs/runs.py), else (an output begun before them) its
    summary.json -- or None: a run with nothing left to decode carries it on, so re-running a
    finished job does not lose the real run's throughput, forward and start-up, nor a stopped
    run's that had written every shard (the trial of failed jobs)."""
    for record in reversed(read_runs(out)):
        if (record.get("this_run") or {}).get("rows_this_run"):
            return {k: record.get(k) for k in ("this_run", "startup", "versions", "status", "ended_at")}
    try:
        prev = json.loads((Path(out) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(prev, dict):
        return None
    if prev.get("last_decoding_run"):
        return prev["last_decoding_run"]
    run = prev.get("this_run") or {}
    return {"this_run": run, "startup": prev.get("startup") or {}} if run.get("rows_this_run") else None


def summarize(out: Path, spec, run_stats: dict, startup: dict | None = None, last_run: dict | None = None,
              runs: list | None = None) -> dict:
    """The job's summary from its shards; ``run_stats``/``startup``: this run's; ``last_run``
    (previous_decoding_run): kept as "last_decoding_run" when this run decoded no row; ``runs``:
    every run's record (jobs/runs.py), this one's last."""
    t = _tally(out, getattr(spec, "samples", 1) > 1)
    checked = t["checked"]
    return {
        "rows": t["rows"],
        "errors": t["errors"],
        "error_messages": _error_messages(t),
        "generated_tokens": t["tokens"],
        "finish_reasons": dict(sorted(t["reasons"].items())),
        "this_run": this_run(run_stats),
        "startup": startup or {},
        **({"last_decoding_run": last_run} if last_run and not run_stats.get("rows_this_run") else {}),
        **{k: t[k].as_dict() for k in _MOMENTS if k != "tokens_per_s"},
        "tokens_per_s_per_prompt": t["tokens_per_s"].as_dict(),
        "lookup_tokens": t["lookup"],
        "prompt_tokens": t["prompt"],
        "cached_prompt_tokens": t["cached"],  # prefix caching: prompt tokens copied, not computed
        "speedup_vs_ar": t["speedup"].as_dict(),
        "equivalence": {
            "checked": checked, "matched": checked - t["mismatches"], "mismatches": t["mismatches"],
            "pass_rate": (checked - t["mismatches"]) / checked if checked else None,
            "mismatched_rows": t["mismatched"],
            "reference": _reference(spec),
        },
        "config": _config(spec),
        "versions": versions(),
        "runs": runs or [],
    }


def write_summary(out: Path, summary: dict) -> None:
    with replaced(Path(out) / "summary.json") as tmp:
        tmp.write_text(json.dumps(summary, indent=2, default=str))


def _per_prompt(s: dict) -> str:
    n = (s.get("config") or {}).get("samples", 1)
    return f"{s['rows'] // n} prompts x {n} samples; " if n > 1 else ""


def format_table(s: dict) -> str:
    def ms(d, fmt="{:.2f}"):
        if d["mean"] is None:
            return "-"
        return f"{fmt.format(d['mean'])} ± {fmt.format(d['std'])}"

    eq = s["equivalence"]
    run = s["this_run"]
    last = (s.get("last_decoding_run") or {}).get("this_run") or {}
    decoded = run if run.get("actors") else last  # (a run with nothing left to decode: the actors of the one that did)
    lines = [
        f"rows                     {s['rows']}  ({_per_prompt(s)}errors {s['errors']})",
        f"generated tokens         {s['generated_tokens']}",
        "job tokens/s (this run)  " + _run_line(run) + _last_run_note(s.get("last_decoding_run")),
        f"start-up                 {startup_line(s.get('startup') or {})}",
        "batch size per actor     " + (", ".join(_batch_of(a) for a in decoded.get("actors", [])) or "-"),
        "actors ran on            " + (_machines(decoded.get("actors", []), decoded.get("nodes")) or "-")
        + (f"; {counted(decoded['actors_lost'], 'actor')} lost during the run (their statistics too)"
           if decoded.get("actors_lost") else ""),
        f"tokens/s per prompt      {ms(s['tokens_per_s_per_prompt'], '{:.1f}')}",
        f"tokens / iteration       {ms(s['tokens_per_iteration'])}",
        f"acceptance rate          {ms(s['acceptance_rate'])}",
        f"tokens from lookup       {s.get('lookup_tokens', 0)}",
        f"prompt tokens cached     {s.get('cached_prompt_tokens', 0)} of {s.get('prompt_tokens', 0)}"
        + (f" ({s['cached_prompt_tokens'] / s['prompt_tokens']:.0%}: shared prompt beginnings computed once)"
           if s.get("cached_prompt_tokens") else ""),
        f"speedup vs ar            {_speedup_line(s)}",
        "matches ar               " + (f"{eq['matched']}/{eq['checked']}{_against(eq)}" if eq["checked"] else
                                           _unchecked(s)),
    ]
    if len(s.get("runs") or []) > 1:  # (a resumed job: what the runs before this one ended with)
        ended = Counter(r.get("status") for r in s["runs"][:-1])
        lines.append(f"runs                     {len(s['runs'])} (before this one: "
                     + ", ".join(f"{n} {status}" for status, n in ended.items()) + f"; see {RUNS})")
    return "\n".join(lines)


def _reference(spec) -> str | None:
    """The ``ar`` the checked rows were compared with (config.reference_label): its window, cache
    dtype and sampling, each row with its own seed (a windowed job read "matches ar 6/6")."""
    cfg = getattr(spec, "method_config", None)
    if cfg is None:
        return None
    label = reference_label(ar_reference(cfg), seed=False)
    return label + (", each row's own seed" if cfg.temperature > 0 else "")


def _against(eq: dict) -> str:
    ref = eq.get("reference")
    return f" (against {ref})" if ref and ref != "ar" else ""


def _unchecked(s: dict) -> str:
    """Why no row was checked: none asked for, or a --verify-fraction that checked none (its sample
    is drawn by id hash, so a small job can draw none; a row with an error is never checked)."""
    fraction = (s.get("config") or {}).get("verify_fraction") or 0
    if not fraction or not s["rows"]:
        return "not checked"
    if s["errors"] == s["rows"]:
        return f"not checked: every one of the {s['rows']} rows has an error (rows with errors are not checked)"
    return (f"not checked: --verify-fraction {fraction} checked none of the {s['rows']} rows (it picks rows by a "
            "hash of their id, so a small job can draw none; rows with errors are not checked)")


def _batch_of(actor: dict) -> str:
    """An actor's batch size at the end; under --batch-size auto, with the best the tuner measured
    (the size it was trying when the job ended can be its slowest, or one it never measured)."""
    rates = actor.get("rates") or {}
    if not rates:
        return str(actor["batch_size"])
    best = max(rates, key=rates.get)
    return f"{actor['batch_size']} (auto; best measured {best}: {rates[best]:.0f} tokens/s)"


def _machines(actors: list[dict], nodes: list | dict | None = None) -> str:
    """'2 actors on Intel(R) Xeon(R) ... with 2 CPUs (2 Ray nodes)': the machines (CPUs, GPUs) this run's
    actors ran on, counted -- the CPUs the machine's, not each actor's ("2 x ..., 2 CPUs" read as 4) --
    and the Ray nodes its actors were ready on, lost ones too (``nodes``; older summaries: the actors')."""
    counts = Counter(a["machine"] for a in actors if a.get("machine"))
    living = {a["node_id"] for a in actors if a.get("node_id")}
    every = {n["node_id"] if isinstance(n, dict) else n for n in nodes or ()} | living  # (older summaries: id -> ip)
    lost = f", the actors on {len(every - living)} of them lost" if every - living else ""
    return "; ".join(f"{n} actor{'s' * (n > 1)} on " + re.sub(r", (\d+) CPUs", r" with \1 CPUs", m)
                     for m, n in counts.most_common()) + (f" ({counted(len(every), 'Ray node')}{lost})" if every else "")


def _run_line(run: dict) -> str:
    refs = sum(a.get("reference_tokens") or 0 for a in run.get("actors") or [])
    return ((f"{run['job_tokens_per_s']:.1f}" if run.get("job_tokens_per_s") else "-")
            + f"  ({run.get('tokens_this_run', 0)} tokens in {run.get('wall_time_s', 0):.1f}s, "
              f"{counted(run.get('shards_this_run', 0), 'shard')}, {counted(run.get('retries', 0), 'retry', 'retries')}; "
              "start-up included"
            + (f"; the actors also decoded {refs} tokens of ar references in the same batches, to check rows: "
               "--verify-fraction 0 leaves them out" if refs else "") + ")")


def _last_run_note(last: dict | None) -> str:
    if not last:
        return ""
    return f"\n  (nothing left to decode; the last run that decoded: {_run_line(last.get('this_run') or {})})"


def _speedup_line(s: dict) -> str:
    """Per-row speedup over the rows' ar references; those decoded at batch size > 1 carry none
    (a row and its reference time the same shared forwards)."""
    sp, checked = s["speedup_vs_ar"], s["equivalence"]["checked"]
    if sp["n"] or not checked:
        mean = "-" if sp["mean"] is None else f"{sp['mean']:.2f} ± {sp['std']:.2f}"
        if sp["n"] < checked:  # (a job resumed at another batch size: some checked rows shared forwards)
            return f"{mean}  (over the {sp['n']} of {checked} checked rows decoded one at a time)"
        return f"{mean}  (rows re-decoded with ar: {sp['n']})"
    return ("-  (checked rows shared forwards at batch size > 1, so per-row times are the batch's: "
            "compare whole jobs' tokens/s, or `dynatree bench --batch-sizes`)")


def startup_total(st: dict) -> float:
    """Seconds before the first row could be decoded: planning, cluster, placement, actors ready."""
    return sum(st.get(k, 0) for k in ("plan_s", "cluster_s", "placement_s", "actors_ready_s"))


def startup_line(st: dict) -> str:
    """Start-up split: planning, cluster, placement, actors ready (load, kernel, profile inside)."""
    if not st:
        return "-"
    if "cluster_s" not in st:  # every shard was already finished: no cluster, no actors
        return f"{st.get('plan_s', 0):.1f}s (planning only: nothing left to decode)"
    a = st.get("actor", {})
    return (f"{startup_total(st):.1f}s (plan {st.get('plan_s', 0):.1f}, cluster {st.get('cluster_s', 0):.1f}, placement "
            f"{st.get('placement_s', 0):.1f}, actors ready {st.get('actors_ready_s', 0):.1f}: model load "
            f"{a.get('load_s', 0):.1f}, kernel {a.get('kernel_s', 0):.1f}, profile {a.get('profile_s', 0):.1f})")
