"""Each run of a job on its output, one JSON line in ``OUT/runs.jsonl``: how it ended and what it left.

A run that fails or is stopped writes no summary.json (its rows are not all there); its line says
what happened (status, the message the command ended with), how far the job is (shards and rows
finished of those planned), which shards failed (their input rows and ids, so their prompts can
be found) and whether the same command resumes it.  ``dynatree report`` reads the last line of an
unfinished output; a finished job's summary.json carries them all as ``runs`` (a resumed job's
summary otherwise describes only its last run: the trial of failed jobs).
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

RUNS = "runs.jsonl"
STATUSES = ("complete", "failed", "interrupted", "terminated", "cluster_lost")


def _now(t: float | None = None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def begin(plan, overwrite: bool, started: float | None = None) -> dict:
    """A run's record as it starts (``started``: when the command began, planning included, as
    this_run.wall_time_s counts it; ``before``: the shards the output already held, once read)."""
    from dynatree.machine import versions

    return {"started_at": _now(started), "pid": os.getpid(), "host": socket.gethostname(), "overwrite": overwrite,
            "versions": versions(), "shards_total": plan.num_shards, "rows_total": plan.rows * plan.samples,
            "shards_before": 0, "rows_before": 0}


def run_ref(record: dict) -> dict:
    """What a shard's footer keeps of the run that wrote it: the keys of its line in runs.jsonl."""
    return {k: record[k] for k in ("started_at", "pid", "host")}


def before(record: dict, plan, done: set[int]) -> None:
    """The shards (and their output rows) the output held when the run began."""
    record["shards_before"] = len(done)
    record["rows_before"] = sum(e - s for _, s, e in map(plan.shard, done)) * plan.samples


def finish(record: dict, status: str, message: str, run_stats: dict, startup: dict) -> dict:
    """The record completed: how the run ended, the shards and rows now finished, its statistics."""
    assert status in STATUSES, status
    gone_shards, gone_rows = run_stats.get("_gone", (0, 0))  # (files deleted while it ran: driver._check_shards_there)
    shards = record.pop("shards_before") + run_stats.get("shards_this_run", 0) - gone_shards
    rows = record.pop("rows_before") + run_stats.get("rows_this_run", 0) - gone_rows
    record.update(ended_at=_now(), status=status, message=message, shards_done=shards, rows_done=rows,
                  failed_shards=run_stats.get("failed_shards", []), this_run=this_run(run_stats), startup=startup)
    return record


def append(out: Path, record: dict) -> None:
    """One line on ``out``'s runs.jsonl (after a line a full disk cut short, on a line of its own);
    an output that cannot take it keeps its shards: the command's own message says what it left."""
    try:
        with open(Path(out) / RUNS, "a+b") as f:
            f.seek(0, os.SEEK_END)
            if f.tell():
                f.seek(-1, os.SEEK_END)
                cut = f.read(1) != b"\n"
            else:
                cut = False
            f.write((b"\n" if cut else b"") + (json.dumps(record, default=str) + "\n").encode())
    except OSError as e:  # (the record was lost without a word: trial AK)
        print(f"warning: this run's record could not be added to {Path(out) / RUNS}: {e.strerror or e}",
              file=sys.stderr)


def end(out: Path, record: dict, status: str, message: str, run_stats: dict, startup: dict) -> dict:
    """finish, then append: a run that did not complete."""
    append(out, finish(record, status, message, run_stats, startup))
    return record


def this_run(run_stats: dict) -> dict:
    """A run's statistics as its summary and its record say them."""
    wall, tokens = run_stats.get("wall_time_s") or 0.0, run_stats.get("tokens_this_run", 0)
    said = {k: v for k, v in run_stats.items() if k != "failed_shards" and not k.startswith("_")}
    if isinstance(said.get("nodes"), dict):  # (keyed by node id, a table of many runs grew a column a node: trial AJ)
        said["nodes"] = [{"node_id": k, "node_ip": v} for k, v in said["nodes"].items()]
    return {**said, "job_tokens_per_s": tokens / wall if wall and tokens else None}


def read(out: Path) -> list[dict]:
    """The output's run records, oldest first (a damaged line, or one not a record, skipped: it must
    never stop a summary or a report)."""
    try:
        lines = (Path(out) / RUNS).read_bytes().decode("utf-8", "replace").splitlines()
    except OSError:
        return []
    runs = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and all(isinstance(record.get(k, {}), dict) for k in ("this_run", "startup")):
            runs.append(record)
    return runs


def failed_shard(plan, k: int, rows: list[dict], attempts: int, error: str) -> dict:
    """A shard that used up its retries, as a record names it: its input rows and ids."""
    name, s, e = plan.shard(k)
    ids = [r["id"] for r in rows]
    return {"shard": name, "input_rows": [s, e - 1], "ids": [ids[0], ids[-1]] if ids else [], "attempts": attempts,
            "error": " ".join(error.split())}  # (one line: Ray's words come in several)


def shard_said(f: dict) -> str:
    s, e = f["input_rows"]
    ids = f.get("ids") or []
    which = f"ids {ids[0]!r}..{ids[1]!r}" if len(ids) == 2 and ids[0] != ids[1] else f"id {ids[0]!r}" if ids else ""
    return f"{f['shard']} (input rows {s}-{e}{', ' + which if which else ''})"


def failure_said(f: dict, max_retries: int | None = None) -> str:
    """One failed shard as the job's error and `dynatree report` both say it: which rows, how many
    attempts (or that its rows could not be read), why."""
    from dynatree.metrics import counted

    retries = f" (--max-retries {max_retries})" if max_retries is not None else ""
    if not f.get("attempts"):  # (its error says its rows could not be read)
        return f"{shard_said(f)}: {f.get('error')}"
    return f"{shard_said(f)} failed after {counted(f['attempts'], 'attempt')}{retries}: {f.get('error')}"


def how_to_go_on(out, overwrite: bool, record: dict | None = None) -> str:
    """How a job that ended early goes on, from the files in ``out`` (--overwrite would start over),
    with how far it got where its ``record`` says."""
    try:
        started = bool(out) and any(Path(out, "shards").glob("part-*.parquet"))
    except OSError:  # (an output it cannot look into: the error said why)
        started = False
    if not started:
        return "no shard was finished; the same command starts the job again"
    said = f"finished shards are kept in {out}; the same command resumes"
    if overwrite:
        said = (f"finished shards are kept in {out}; to resume, run it without --overwrite (a job file that sets "
                "overwrite: true needs --no-overwrite) -- as it is, the command would start over")
    if record is not None and record["shards_done"] == record["shards_total"]:  # (read "1 of 1 finished" and
        return ("every shard is finished; the same command writes the summary without decoding"  # "not finished")
                + (" (without --overwrite)" if overwrite else ""))
    if record is not None:
        said = f"{progress_said(record)}; " + said
    return said


def progress_said(record: dict) -> str:
    return (f"{record['shards_done']} of {record['shards_total']} shards ({record['rows_done']} of "
            f"{record['rows_total']} rows) are finished")


def describe(out, record: dict) -> str:
    """An unfinished output's state, from its last run's record (dynatree report)."""
    failed = record.get("failed_shards") or []  # (said below, shard by shard: not twice)
    message = record.get("message") or ""
    said = message and not failed and not message.startswith(str(record.get("status")))  # ("interrupted: interrupted")
    took = f"{record.get('status')}" + (f": {message}" if said else "")
    lines = [f"{out}: the job has not finished: its last run (pid {record.get('pid')} on {record.get('host')}, "
             f"{record.get('started_at')} to {record.get('ended_at')}) ended {took}"]
    lines += [failure_said(f) for f in failed]
    advised = not failed and any(w in (record.get("message") or "") for w in ("resume", "re-run", "same command"))
    lines.append(progress_said(record) if advised else how_to_go_on(out, bool(record.get("overwrite")), record))
    return "\n".join(lines)
