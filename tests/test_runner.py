"""The batch runner end to end on a real local Ray cluster, real Parquet files and tiny models."""
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
import yaml

from dynatree.jobs.driver import JobError, run_job, start_local_ray
from dynatree.jobs.spec import FAULTS_ENV, SpecError, build_spec
from dynatree.jobs.summary import format_table, read_rows

PROMPTS = ["The quick brown fox", "It was the best of times", "Call me Ishmael.", "Some years ago",
           "never mind how long", "The lazy dog", "it was the worst", "precisely the best",
           "quick quick brown", "Ishmael jumps over", "the times", "brown dog"]


@pytest.fixture(scope="module")
def ray_cluster():
    ray = start_local_ray(num_cpus=2, log_to_driver=False)
    yield
    ray.shutdown()


def spec(pair_dirs, tmp_path, **kw):
    base = dict(input=str(tmp_path / "in.parquet"), output=str(tmp_path / "out"),
                target=str(pair_dirs / "target"), draft=str(pair_dirs / "draft"), method="dynatree",
                max_new_tokens=12, dtype="float64", device="cpu", shard_size=4, num_actors=2,
                cpus_per_actor=1, verify_fraction=1.0, id_column="key")
    base.update(kw)
    return build_spec(None, **base)


def write_input(tmp_path, texts=PROMPTS, keys=None):
    keys = keys or [f"k{i}" for i in range(len(texts))]
    pq.write_table(pa.table({"key": keys, "text": texts}), tmp_path / "in.parquet")


def quiet(*a):
    pass


def test_end_to_end_two_actors_verify_all(ray_cluster, pair_dirs, tmp_path):
    texts = PROMPTS + [None, "", "   "]
    write_input(tmp_path, texts)
    summary = run_job(spec(pair_dirs, tmp_path), progress=False, log=quiet)
    rows = read_rows(tmp_path / "out")
    assert [r["id"] for r in rows] == [f"k{i}" for i in range(len(texts))]
    good = rows[:len(PROMPTS)]
    assert all(r["error"] is None and r["matches_ar"] is True for r in good)
    assert all(r["num_generated_tokens"] == len(r["generated_token_ids"]) > 0 for r in good)
    assert all(r["error"] and r["finish_reason"] == "error" for r in rows[len(PROMPTS):])
    assert "null" in rows[-3]["error"] and "empty" in rows[-2]["error"]
    assert summary["rows"] == len(texts) and summary["errors"] == 3
    assert summary["equivalence"]["checked"] == len(PROMPTS) and summary["equivalence"]["mismatches"] == 0
    assert summary["versions"]["ray"] and summary["config"]["method"] == "dynatree"
    if (Path(__file__).resolve().parent.parent / ".git").exists():  # (a checkout's commit: a number names no change)
        assert len(summary["versions"]["commit"].removesuffix("+changes")) == 40
    assert sorted(os.listdir(tmp_path / "out" / "shards")) == [f"part-{i:06d}.parquet" for i in range(4)]
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["rows"] == len(texts)
    # each shard's footer holds its part of the summary (a summary reads footers, not columns): the
    # same tally as from the columns, which shards of an older version (no tally) still get
    from dynatree.jobs.summary import _Moments, _tally, shard_files

    def tally():
        return {k: v.as_dict() if isinstance(v, _Moments) else v for k, v in _tally(tmp_path / "out").items()}

    stored = tally()
    for f in shard_files(tmp_path / "out"):
        table = pq.read_table(f)
        meta = json.loads(table.schema.metadata[b"dynatree"])
        assert meta.pop("tally")["rows"] == table.num_rows
        pq.write_table(table.replace_schema_metadata({b"dynatree": json.dumps(meta).encode()}), f)
    assert tally() == stored and stored["errors"] == 3 and stored["tokens_per_s"]["n"] == len(PROMPTS)


def test_resume_redoes_only_unfinished_shards(ray_cluster, pair_dirs, tmp_path):
    write_input(tmp_path)
    run_job(spec(pair_dirs, tmp_path, verify_fraction=0.0), progress=False, log=quiet)
    shards = tmp_path / "out" / "shards"
    before = {f: os.stat(shards / f).st_mtime_ns for f in os.listdir(shards)}
    os.remove(shards / "part-000001.parquet")  # as if the driver died while it was in flight
    manifest = (tmp_path / "out" / "manifest.json").read_bytes()
    assert json.loads(manifest)["leading_ids"] == []  # (pinned by the actors: this tokenizer puts no BOS)
    plan = run_job(spec(pair_dirs, tmp_path, verify_fraction=0.0), progress=False, log=quiet, dry_run=True)
    assert (plan["shards"], plan["shards_done"], plan["rows_to_decode"]) == (3, 2, 4)
    assert (plan["target"], plan["draft"]) == (str(pair_dirs / "target"), str(pair_dirs / "draft"))  # the models named
    assert plan["actors"].endswith("on this process's Ray cluster (not asked in a dry run: whether they fit is "
                                   "checked when the job starts)"), plan["actors"]
    assert (tmp_path / "out" / "manifest.json").read_bytes() == manifest and len(os.listdir(shards)) == 2
    eight = run_job(spec(pair_dirs, tmp_path, num_actors=8, cpus_per_actor=0.25, address=None, verify_fraction=0.0,
                         prefix_cache_gb=10.0), progress=False, log=quiet, dry_run=True)  # (its memory: trial AE)
    assert eight["memory"].startswith("each actor needs ~20.6 GiB before its rows") and "when the job starts" \
        in eight["memory"], eight["memory"]  # (this process's cluster: its nodes are asked when the job starts)
    import ray
    from dynatree.jobs.driver import _memory_said
    with pytest.MonkeyPatch.context() as mp:  # (a local job: this machine, as the run will say it)
        mp.setattr(ray, "is_initialized", lambda: False)
        local = _memory_said(spec(pair_dirs, tmp_path, num_actors=8, cpus_per_actor=0.25, prefix_cache_gb=10.0))
    assert local.startswith("each actor needs ~20.6 GiB") and "--prefix-cache-gb 10 counts" in local, local
    plan = run_job(spec(pair_dirs, tmp_path, verify_fraction=0.0, overwrite=True), progress=False, log=quiet,
                   dry_run=True)  # (a job file's overwrite: true read as a resume: the failed-jobs trial)
    assert plan["overwrite"] is True and plan["overwrite_deletes"].startswith(f"the 2 shard file(s) in {shards}, its")
    said = []  # a slow dtype on this machine's CPUs is said in the dry run, as the run says it (its trial missed it)
    run_job(spec(pair_dirs, tmp_path, verify_fraction=0.0, dtype="float16", output=str(tmp_path / "f16"), device="cpu"),
            progress=False, log=said.append, dry_run=True)
    assert any(line.startswith("warning: CPU actors: dtype float16 on a CPU") for line in said), said
    with pytest.raises(JobError, match="different config .*max_new_tokens"):  # what a run would refuse
        run_job(spec(pair_dirs, tmp_path, verify_fraction=0.0, max_new_tokens=5), progress=False, log=quiet,
                dry_run=True)
    foreign = shards / "part-000001.parquet"  # named like a shard, but not one dynatree wrote: never overwritten
    pq.write_table(pa.table({"x": [1]}), foreign)
    with pytest.raises(JobError, match="did not write \\(part-000001.parquet: no dynatree shard metadata"):
        run_job(spec(pair_dirs, tmp_path, verify_fraction=0.0), progress=False, log=quiet, dry_run=True)
    foreign.write_bytes(b"")  # a damaged file (what no whole write leaves): redone
    plan = run_job(spec(pair_dirs, tmp_path, verify_fraction=0.0), progress=False, log=quiet, dry_run=True)
    assert (plan["shards_done"], plan["rows_to_decode"]) == (2, 4)
    os.remove(foreign)
    def read_only(directory, room=0):  # a read-only mount (root passes permission bits: the dry run probes)
        raise OSError(30, "Read-only file system", str(directory / ".write-probe"))

    from dynatree.jobs import driver as job_driver

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(job_driver, "ensure_writable", read_only)
        with pytest.raises(JobError, match="is not writable: .*Read-only file system"):
            run_job(spec(pair_dirs, tmp_path, verify_fraction=0.0), progress=False, log=quiet, dry_run=True)
    summary = run_job(spec(pair_dirs, tmp_path, verify_fraction=0.0), progress=False, log=quiet)
    assert summary["this_run"]["shards_this_run"] == 1 and summary["rows"] == len(PROMPTS)
    # what the first run's actors pinned survives the resume (every run had rewritten the manifest without
    # the context and the text rule, and the next resume refused the job's own shards as an older version's)
    pinned = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert {"leading_ids", "context", "text_rule"} <= set(pinned), pinned
    from dynatree.jobs.plan import check_output, make_plan
    job = spec(pair_dirs, tmp_path, verify_fraction=0.0)
    kept = check_output(job, make_plan(job, quiet))
    assert {k: kept.get(k) for k in ("leading_ids", "context", "text_rule")} == \
        {k: pinned[k] for k in ("leading_ids", "context", "text_rule")}
    after = {f: os.stat(shards / f).st_mtime_ns for f in os.listdir(shards)}
    assert after["part-000000.parquet"] == before["part-000000.parquet"]
    assert after["part-000002.parquet"] == before["part-000002.parquet"]
    assert [r["id"] for r in read_rows(tmp_path / "out")] == [f"k{i}" for i in range(len(PROMPTS))]
    for _ in range(2):  # runs with nothing left to decode keep the record of the last run that decoded
        noop = run_job(spec(pair_dirs, tmp_path, verify_fraction=0.0), progress=False, log=quiet)
        assert noop["this_run"]["rows_this_run"] == 0 and noop["this_run"]["job_tokens_per_s"] is None
        assert {k: noop["last_decoding_run"][k] for k in ("this_run", "startup")} == \
            json.loads(json.dumps({k: summary[k] for k in ("this_run", "startup")}, default=str))
        assert noop["last_decoding_run"]["versions"] == summary["versions"]  # (the outputs' version: trial AF)
        assert noop["rows"] == summary["rows"]
    assert "nothing left to decode; the last run that decoded: " in format_table(noop)
    # ... and its actors, as the run that decoded had them (both lines read "-")
    for line in ("batch size per actor", "actors ran on"):
        was, now = (next(ln for ln in format_table(x).splitlines() if ln.startswith(line)) for x in (summary, noop))
        assert now == was and not now.endswith(" -"), now
    assert "matches ar               not checked\n" in format_table(noop) + "\n"  # (none asked for)
    picked_none = {**noop, "config": {**noop["config"], "verify_fraction": 0.01}}  # a sample that came out empty
    assert f"not checked: --verify-fraction 0.01 checked none of the {len(PROMPTS)} rows" in format_table(picked_none)
    # a different config on the same directory is refused, unless overwrite
    with pytest.raises(JobError, match="different config .*max_new_tokens"):
        run_job(spec(pair_dirs, tmp_path, verify_fraction=0.0, max_new_tokens=5), progress=False, log=quiet)
    from dynatree.jobs import driver

    def no_actor(self, ray, n):
        raise JobError("1 of 1 actor(s) not ready")

    kept = {p.name: p.read_bytes() for p in (*shards.iterdir(), tmp_path / "out" / "manifest.json",
                                             tmp_path / "out" / "summary.json")}
    with pytest.MonkeyPatch.context() as mp:  # an overwrite that cannot start leaves the old output whole
        mp.setattr(driver._Dispatch, "_start", no_actor)
        with pytest.raises(JobError, match="not ready"):
            run_job(spec(pair_dirs, tmp_path, verify_fraction=0.0, max_new_tokens=5, overwrite=True), progress=False,
                    log=quiet)
    assert {p.name: p.read_bytes() for p in (*shards.iterdir(), tmp_path / "out" / "manifest.json",
                                             tmp_path / "out" / "summary.json")} == kept
    (tmp_path / "out" / "notes.txt").write_text("mine")  # overwrite removes what dynatree wrote, only that
    s = run_job(spec(pair_dirs, tmp_path, verify_fraction=0.0, max_new_tokens=5, overwrite=True, stop=("zq",)),
                progress=False, log=quiet)
    assert s["this_run"]["shards_this_run"] == 3
    assert all(r["num_generated_tokens"] <= 5 for r in read_rows(tmp_path / "out"))
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"
    # a field a job without it leaves out of its identity is still named when it changes
    with pytest.raises(JobError, match=r"different config \(changed: stop: \[\"zq\"\] -> \[\]\)"):  # (its values)
        run_job(spec(pair_dirs, tmp_path, verify_fraction=0.0, max_new_tokens=5), progress=False, log=quiet)
    # options given at their defaults, or as strings, are the same job; a changed one is named with its values
    again = dict(verify_fraction=0.0, max_new_tokens=5, stop=("zq",))
    plan = run_job(spec(pair_dirs, tmp_path, **again, options={"d_max": "8", "temperature": 0}), progress=False,
                   log=quiet, dry_run=True)
    assert (plan["shards_done"], plan["rows_to_decode"]) == (3, 0)
    with pytest.raises(JobError, match=r"different config \(changed: options d_max: default -> 6\)"):
        run_job(spec(pair_dirs, tmp_path, **again, options={"d_max": 6}), progress=False, log=quiet, dry_run=True)


def faults(monkeypatch, **kw):
    monkeypatch.setenv(FAULTS_ENV, json.dumps(kw))  # reaches the actors through their runtime_env


def test_actor_killed_mid_job_still_yields_exact_rows(ray_cluster, pair_dirs, tmp_path, monkeypatch):
    write_input(tmp_path)
    faults(monkeypatch, die_once_on_shard="part-000001")
    s = run_job(spec(pair_dirs, tmp_path, batch_size=3), progress=False, log=quiet)
    rows = read_rows(tmp_path / "out")
    assert [r["id"] for r in rows] == [f"k{i}" for i in range(len(PROMPTS))]
    assert s["this_run"]["retries"] >= 1 and s["equivalence"]["mismatches"] == 0
    assert (tmp_path / "out" / ".fault-part-000001").exists()
    from dynatree.jobs.summary import format_table  # (a lost actor had left no trace in the table)
    assert s["this_run"]["actors_lost"] == 1 and "; 1 actor lost during the run" in format_table(s)


@pytest.mark.parametrize("told", ["by Ray's words", "by its raylet"])
def test_shards_lost_with_a_node_are_requeued_not_charged(ray_cluster, pair_dirs, tmp_path, monkeypatch, told):
    """A node lost mid-job charged a retry to a shard that did nothing wrong (--max-retries 0 failed
    the job), and re-ran every shard its actor held alone, one at a time (the two-node trial): such
    shards go back to the queue as any other, uncharged -- also where the actor's death arrives
    before Ray's word that its node died (a killed raylet: the multi-node trial)."""
    from ray.exceptions import RayActorError

    from dynatree.jobs import driver as job_driver
    from dynatree.jobs import placement

    lost = RayActorError(None, "The actor died unexpectedly before finishing this task.\n"
                               "The actor died because its node has died. Node Id: 65a3")
    assert placement.node_died(lost) and not placement.node_died(RayActorError(None, "killed by OOM"))
    write_input(tmp_path, PROMPTS * 2)
    faults(monkeypatch, die_once_on_shard="part-000001")
    if told == "by Ray's words":
        monkeypatch.setattr(placement, "node_died", lambda err: True)  # (this death as a lost node's)
    else:  # (its node's raylet found gone: the actor known on a node, the probe's answer)
        asked = []
        monkeypatch.setattr(job_driver._Dispatch, "_node_gone",
                            lambda self, ray, actor: asked.append(self.actor_nodes.get(actor)) or True)
    said = []
    s = run_job(spec(pair_dirs, tmp_path, max_retries=0, verify_fraction=0.0), progress=False, log=said.append)
    assert any("part-000001's actor was lost with its node; requeued" in m for m in said), said
    assert not any("alone" in m or "retry" in m for m in said), said
    assert sorted(r["id"] for r in read_rows(tmp_path / "out")) == sorted(f"k{i}" for i in range(2 * len(PROMPTS)))
    assert s["this_run"]["retries"] >= 1
    if told == "by its raylet":
        assert asked and all(n in [m["node_id"] for m in s["this_run"]["nodes"]] for n in asked), asked


def test_a_dead_actors_node_is_gone_when_its_raylet_does_not_answer():
    """_node_gone: the head's word (Alive false) or a raylet port that refuses a connection says a
    node is gone (and stays so); a raylet that answers, or an actor of no known node, does not."""
    import socket
    from types import SimpleNamespace

    from dynatree.jobs import driver as job_driver

    d = job_driver._Dispatch.__new__(job_driver._Dispatch)
    listening = socket.create_server(("127.0.0.1", 0))
    closed = socket.create_server(("127.0.0.1", 0))
    dead_port = closed.getsockname()[1]
    closed.close()
    nodes = [{"NodeID": "a", "Alive": True, "NodeManagerAddress": "127.0.0.1",
              "NodeManagerPort": listening.getsockname()[1]},
             {"NodeID": "b", "Alive": True, "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": dead_port},
             {"NodeID": "c", "Alive": False, "NodeManagerAddress": "127.0.0.1",
              "NodeManagerPort": listening.getsockname()[1]}]
    fake = SimpleNamespace(nodes=lambda: nodes)
    d.actor_nodes, d.gone_nodes = {"x": "a", "y": "b", "z": "c"}, set()
    try:
        assert [d._node_gone(fake, actor) for actor in "xyzw"] == [False, True, True, False]
        assert d.gone_nodes == {"b", "c"}
        nodes[1]["NodeManagerPort"] = listening.getsockname()[1]  # (a gone node stays gone: its id is never reused)
        assert d._node_gone(fake, "y")
    finally:
        listening.close()


def test_retries_exhausted_fails_loudly_and_keeps_finished_shards(ray_cluster, pair_dirs, tmp_path, monkeypatch):
    write_input(tmp_path)
    faults(monkeypatch, die_always_on_shard="part-000002")
    with pytest.raises(JobError, match=r"1 shard could not be decoded: part-000002 \(input rows \d+-\d+, ids 'k\d+'..'k\d+'\) "
                                       r"failed after 2 attempts \(--max-retries 1\): .*the rest are finished in .*runs.jsonl "
                                       r"records the failed ones\): a re-run decodes only those"):
        run_job(spec(pair_dirs, tmp_path, max_retries=1, verify_fraction=0.0), progress=False, log=quiet)
    done = sorted(os.listdir(tmp_path / "out" / "shards"))
    assert "part-000002.parquet" not in done and "part-000000.parquet" in done
    from dynatree.jobs import runs  # (nothing on disk said the job had failed, or which rows: the failed-jobs trial)
    last = runs.read(tmp_path / "out")[-1]
    assert last["status"] == "failed" and last["shards_done"] == len(done) and last["shards_total"] == len(done) + 1
    assert [f["shard"] for f in last["failed_shards"]] == ["part-000002"] and last["failed_shards"][0]["attempts"] == 2
    from click.testing import CliRunner
    from dynatree.cli import main
    res = CliRunner().invoke(main, ["report", str(tmp_path / "out")])
    assert res.exit_code == 1 and "its last run (pid" in res.output and "part-000002 (input rows" in res.output and "failed after 2 attempts: " in res.output
    assert res.output.count(last["failed_shards"][0]["error"][:40]) == 1  # (it was said twice: trial AI)
    assert f"{len(done)} of {len(done) + 1} shards (" in res.output and "the same command resumes" in res.output
    monkeypatch.delenv(FAULTS_ENV)
    s = run_job(spec(pair_dirs, tmp_path, max_retries=1, verify_fraction=0.0), progress=False, log=quiet)
    assert [r["status"] for r in s["runs"]] == ["failed", "complete"] and s["runs"][-1]["rows_done"] == s["rows"]


def test_a_shard_whose_rows_cannot_be_read_fails_alone(ray_cluster, pair_dirs, tmp_path):
    """A damaged page in one file of a directory input (its footer whole: planned) failed the whole job
    when its shard was read, losing the rows in flight with it (trial AD): now that shard fails, named
    in runs.jsonl, and every other shard is written."""
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"text": PROMPTS[:8], "key": [f"a{i}" for i in range(8)]}), tmp_path / "in" / "a.parquet")
    pq.write_table(pa.table({"text": PROMPTS[8:], "key": [f"b{i}" for i in range(4)]}), tmp_path / "in" / "b.parquet")
    damaged = bytearray((tmp_path / "in" / "b.parquet").read_bytes())
    damaged[4:40] = b"\0" * 36  # (the text column's first page header)
    (tmp_path / "in" / "b.parquet").write_bytes(bytes(damaged))
    with pytest.raises(JobError, match=r"1 shard could not be decoded: part-000002 \(input rows 8-11\): cannot read its input "
                                       r"rows: .*b.parquet: cannot read rows 0-3"):
        run_job(spec(pair_dirs, tmp_path, input=str(tmp_path / "in"), num_actors=1, verify_fraction=0.0),
                progress=False, log=quiet)
    assert sorted(r["id"] for r in read_rows(tmp_path / "out")) == sorted(f"a{i}" for i in range(8))
    from dynatree.jobs import runs
    assert [f["shard"] for f in runs.read(tmp_path / "out")[-1]["failed_shards"]] == ["part-000002"]
    kept = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out" / "shards").iterdir()}
    pq.write_table(pa.table({"text": PROMPTS[8:], "key": [f"b{i}" for i in range(4)]}), tmp_path / "in" / "b.parquet")
    s = run_job(spec(pair_dirs, tmp_path, input=str(tmp_path / "in"), num_actors=1, verify_fraction=0.0),
                progress=False, log=quiet)  # (repaired in place: the resume was refused as a changed input, trial AI)
    assert s["rows"] == 12 and s["this_run"]["shards_this_run"] == 1
    assert all((tmp_path / "out" / "shards" / n).stat().st_mtime_ns == t for n, t in kept.items())
    pq.write_table(pa.table({"text": PROMPTS[:8], "key": [f"c{i}" for i in range(8)]}), tmp_path / "in" / "a.parquet")
    with pytest.raises(JobError, match=r"changed since .*a.parquet: time \d+\.\d{9} -> "):  # (a finished shard's)
        run_job(spec(pair_dirs, tmp_path, input=str(tmp_path / "in"), num_actors=1, verify_fraction=0.0),
                progress=False, log=quiet)


def test_a_replacement_actor_that_never_gets_ready_is_given_up(ray_cluster, pair_dirs, tmp_path, monkeypatch):
    """An actor dies and its replacement never becomes ready (its node was lost and no other has
    room): the other actors decode every shard meanwhile (shards handed to it waited for its
    deadline: the two-node trial), and after its deadline (at most --ready-timeout-s) it is given
    up.  (The first actors keep a generous --ready-timeout-s: on a loaded host they took over 8 s to load.)"""
    from dynatree.jobs import driver

    texts = PROMPTS * 6
    write_input(tmp_path, texts)  # (a late shard stalls: the job outlasts the replacement's deadline, loaded or not)
    faults(monkeypatch, die_once_on_shard="part-000001", never_ready_after_death=True, stall_on_shard="part-000010",
           stall_s=4.0)
    monkeypatch.setattr(driver, "REPLACE_MIN_S", 1.0)
    monkeypatch.setattr(driver, "REPLACE_FACTOR", 0.0)
    said = []
    s = run_job(spec(pair_dirs, tmp_path, ready_timeout_s=120, verify_fraction=0.0), progress=False,
                log=said.append)
    assert any("replacement was not ready after 1 s" in m and "going on with 1 actor" in m
               for m in said), said
    assert sorted(r["id"] for r in read_rows(tmp_path / "out")) == sorted(f"k{i}" for i in range(len(texts)))
    assert s["errors"] == 0


def test_a_replacement_actor_that_cannot_load_ends_the_job_with_its_reason(ray_cluster, pair_dirs, tmp_path,
                                                                          monkeypatch):
    """The model files damaged mid-job: every replacement failed to load, and each shard was
    retried through such actors (~100 start-ups in 11 min for 26 shards) and then called failed
    (the faults trial).  Replacements that fail to load --max-retries + 1 times in a row end the
    job, saying why; no shard is charged for them."""
    write_input(tmp_path, PROMPTS * 3)
    faults(monkeypatch, die_once_on_shard="part-000001", fail_load_after_death=True)
    t0 = time.time()
    said = []
    with pytest.raises(JobError, match=r"actor \d's replacement failed to start 3 times in a row: PairError: cannot "
                                       r"load model 'target': incomplete metadata.*once fixed the same command resumes"):
        run_job(spec(pair_dirs, tmp_path, num_actors=1, verify_fraction=0.0, max_retries=2), progress=False,
                log=said.append)
    assert sum("failed to start (PairError" in m and "starting another" in m for m in said) == 2, said
    assert time.time() - t0 < 120


def test_a_stalled_actor_is_reported_not_waited_on_silently(ray_cluster, pair_dirs, tmp_path, monkeypatch):
    from dynatree.jobs import driver

    write_input(tmp_path)
    faults(monkeypatch, stall_on_shard="part-000001", stall_s=4.0)
    monkeypatch.setattr(driver, "QUIET_S", 1.0)
    said = []
    run_job(spec(pair_dirs, tmp_path, verify_fraction=0.0), progress=False, log=said.append)
    quiet = [m for m in said if m.startswith("no shard finished in the last")]
    assert quiet and "part-000001" in quiet[0] and "on actor" in quiet[0]
    assert len(read_rows(tmp_path / "out")) == len(PROMPTS)


@pytest.mark.parametrize("method,batch_size", [("ar", 3), ("dynatree", 5), ("linear", "auto")])
def test_batched_jobs_match_ar(ray_cluster, pair_dirs, tmp_path, method, batch_size):
    write_input(tmp_path)
    s = run_job(spec(pair_dirs, tmp_path, method=method, batch_size=batch_size, num_actors=1), progress=False,
                log=quiet)
    from dynatree.jobs.summary import format_table
    refs = s["this_run"]["actors"][0]["reference_tokens"]  # (decoded in the job's batches: trial AF)
    assert s["equivalence"]["checked"] == len(PROMPTS) and s["equivalence"]["mismatches"] == 0
    assert refs == s["generated_tokens"] and f"also decoded {refs} tokens of ar references" in format_table(s)
    assert s["this_run"]["actors"][0]["steps"] > 0
    # a row and its ar reference shared forwards: no per-row speedup is claimed
    from dynatree.machine import cpu, describe
    assert s["speedup_vs_ar"]["n"] == 0 and "shared forwards at batch size > 1" in format_table(s)
    # the CPU its rates came from (the actor is on this machine)
    machine = re.sub(r", (\d+) CPUs", r" with \1 CPUs", describe(cpu()))  # (the machine's CPUs, not the actor's)
    assert f"actors ran on            1 actor on {machine} (1 Ray node)" in format_table(s), format_table(s)
    import ray  # (and which node each actor ran on: a multi-node user checks the spread)
    here = ray.get_runtime_context().get_node_id()
    assert s["this_run"]["actors"][0]["node_id"] == here and [n["node_id"] for n in s["this_run"]["nodes"]] == [here]
    from dynatree.jobs.summary import _machines  # (a node whose actor was lost still counts: the resource trial)
    gone = {"node_id": "gone", "node_ip": "10.0.0.9"}
    for nodes in ([*s["this_run"]["nodes"], gone], {here: "ip", "gone": "10.0.0.9"}):  # (and an older summary's)
        assert _machines(s["this_run"]["actors"], nodes).endswith("(2 Ray nodes, the actors on 1 of them lost)")
    from dynatree.jobs import runs  # (each shard names the run that wrote it: its line in runs.jsonl, trial AJ)
    from dynatree.jobs.plan import META_KEY
    last = runs.read(tmp_path / "out")[-1]
    for f in (tmp_path / "out" / "shards").glob("part-*.parquet"):
        meta = json.loads(pq.read_schema(f).metadata[META_KEY])
        assert meta["run"] == {k: last[k] for k in ("started_at", "pid", "host")}, meta
    from click.testing import CliRunner
    from dynatree.cli import main
    res = CliRunner().invoke(main, ["report", str(tmp_path / "out")])  # a run's output: its table again
    assert res.exit_code == 0 and format_table(json.loads((tmp_path / "out" / "summary.json").read_text())) in res.output
    assert "warning" not in res.output
    os.remove(tmp_path / "out" / "shards" / "part-000001.parquet")  # (the table would count rows no longer there)
    res = CliRunner().invoke(main, ["report", str(tmp_path / "out")])
    assert "shards holds 2 of the job's 3 shards now" in res.output, res.output
    res = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert res.exit_code == 1 and "nor a finished `dynatree run` output" in res.output
    assert all(r["ar_tokens_per_s"] is None for r in read_rows(tmp_path / "out"))
    os.remove(tmp_path / "out" / "summary.json")  # a job stopped or failed before its summary: said as such
    res = CliRunner().invoke(main, ["report", str(tmp_path / "out")])
    assert res.exit_code == 1 and "whose job has not finished (2 of 3 shards written, no summary.json" in res.output


def test_actors_and_auto_batch_follow_the_memory_estimate(ray_cluster, pair_dirs, tmp_path, monkeypatch):
    """Models whose actors the node's memory cannot hold two of (made so by a process footprint of
    60% of the node): one actor starts where the CPUs hold two, auto's batch is capped, both said."""
    import ray
    from dynatree.jobs import footprint

    node = ray.nodes()[0]["Resources"]
    free = footprint.HEADROOM * (node["memory"] + node["object_store_memory"])
    monkeypatch.setattr(footprint, "RUNTIME_BYTES", int(0.6 * free))
    # each of the two models' caches 0.4 / 7 of the node a row: room for 3.5 rows beside the process
    monkeypatch.setattr(footprint, "_model", lambda *a: (0, 0, 0, int(0.4 * free / 7)))
    write_input(tmp_path)
    said = []
    s = run_job(spec(pair_dirs, tmp_path, num_actors=None, prefix_cache_gb=0.0, verify_fraction=0.0), progress=False,
                log=said.append)
    text = "\n".join(map(str, said))
    assert "starting 1 actor(s), not the 2 the CPUs hold" in text and "auto capped near 3 row(s)" in text
    assert "1 actor(s) ready" in text and s["rows"] == len(PROMPTS)


def test_an_actor_caps_auto_by_what_it_holds_once_loaded(pair_dirs, tmp_path):
    """The actor's own cap (ShardWorker._cap_batch): its share of the node minus what it holds once
    loaded, in rows of its models' caches -- measured, whatever the estimate assumed."""
    from dynatree.actors.worker import ShardWorker
    from dynatree.jobs import footprint

    import gc

    job = spec(pair_dirs, tmp_path, dtype="float32", prefix_cache_gb=0.0)
    rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    gc.unfreeze()
    free = ShardWorker(job, 1, share=rss + 10 * 2**30)  # room for more rows than auto would try
    assert gc.get_freeze_count() > 0  # a loaded actor takes its heap out of full collections (metrics.freeze_heap)
    assert free.batch_cap is None and free.scheduler.tuner.max_size == job.max_batch_size
    configs = [m.config.to_dict() for m in (free.pair.target, free.pair.draft)]
    per_row = footprint.rows_for(job, configs, free.pair.max_context, 0, 0)[1]
    rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    tight = ShardWorker(job, 1, share=rss + 5.5 * per_row)  # (what the second pair adds is in the measure)
    assert 1 <= tight.batch_cap <= 5 and tight.scheduler.tuner.max_size == tight.batch_cap
    assert tight.ready()["batch_cap"] == tight.batch_cap


def test_an_ar_reference_computes_its_prompt_as_its_row_did(pair_dirs, tmp_path, monkeypatch):
    """A checked row's ar reference is timed against the row (speedup vs ar), so it must not copy the
    prompt the row just computed from the prefix store: with prefix caching on, both compute a
    fresh prompt, and both copy a prompt beginning that other rows share."""
    from dynatree.actors.worker import ShardWorker
    from dynatree.engine import BatchDecoder

    seen = []
    real = BatchDecoder._prefill

    def prefill(self, rows):
        real(self, rows)
        seen.extend((type(r.cfg).__name__, r.cached_tokens) for r in rows)

    monkeypatch.setattr(BatchDecoder, "_prefill", prefill)
    job = spec(pair_dirs, tmp_path, dtype="float32", batch_size=1, verify_fraction=1.0, max_new_tokens=4)
    worker = ShardWorker(job, 1)
    shared = "Call me Ishmael. Some years ago, never mind how long precisely. Call me Ishmael. "  # ~72 tokens
    fresh = [" ".join(PROMPTS[i:] + PROMPTS[:i]) for i in (0, 1)]  # ~80 tokens, beginning apart
    rows = [{"id": f"r{i}", "text": t} for i, t in enumerate(fresh + [shared + p for p in PROMPTS[2:5]])]
    results = worker.run_shard("s0", rows)
    assert all(r["matches_ar"] for r in results)
    gen = [c for kind, c in seen if kind != "ARConfig"]
    ref = [c for kind, c in seen if kind == "ARConfig"]
    assert gen[:2] == ref[:2] == [0, 0]  # fresh prompts: the reference computes it too
    assert gen[-1] > 0 and ref[-1] == gen[-1]  # a shared beginning: both copy it


def test_jsonl_and_arrow_inputs(ray_cluster, pair_dirs, tmp_path):
    recs = [{"key": f"j{i}", "text": t} for i, t in enumerate(PROMPTS[:5])]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    feather.write_feather(pa.Table.from_pylist(recs), tmp_path / "in.arrow")
    for name in ("in.jsonl", "in.arrow"):
        out = tmp_path / f"out-{name}"
        s = run_job(spec(pair_dirs, tmp_path, input=str(tmp_path / name), output=str(out), num_actors=1,
                         batch_size=1), progress=False, log=quiet)
        assert s["rows"] == 5 and s["equivalence"]["mismatches"] == 0
        assert s["speedup_vs_ar"]["n"] == 5  # decoded one at a time: rows and references timed apart
        assert [r["id"] for r in read_rows(out)] == [f"j{i}" for i in range(5)]


def test_bad_inputs_fail_before_any_work(pair_dirs, tmp_path):
    write_input(tmp_path)
    (tmp_path / "out" / "shards").mkdir(parents=True)
    (tmp_path / "out" / "shards" / "mine.parquet").write_text("a user's file")
    for overwrite in (False, True):  # read as output by pyarrow.dataset(out/shards); never deleted
        with pytest.raises(JobError, match="holds files dynatree did not write \\(mine.parquet\\)"):
            run_job(spec(pair_dirs, tmp_path, overwrite=overwrite), progress=False, log=quiet)
    assert (tmp_path / "out" / "shards" / "mine.parquet").exists()
    os.remove(tmp_path / "out" / "shards" / "mine.parquet")
    # named like a shard, but not one dynatree wrote (no shard metadata): --overwrite keeps it too
    pq.write_table(pa.table({"x": [1]}), tmp_path / "out" / "shards" / "part-000005.parquet")
    with pytest.raises(JobError, match="did not write \\(part-000005.parquet: no dynatree shard metadata"):
        run_job(spec(pair_dirs, tmp_path, overwrite=True), progress=False, log=quiet)
    assert pq.read_table(tmp_path / "out" / "shards" / "part-000005.parquet").num_rows == 1
    os.remove(tmp_path / "out" / "shards" / "part-000005.parquet")
    (tmp_path / "out" / "shards" / ".DS_Store").write_text("")  # what pyarrow.dataset skips is no obstacle
    with pytest.raises(JobError, match="no prompt column 'body'"):
        run_job(spec(pair_dirs, tmp_path, prompt_column="body"), progress=False, log=quiet)
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(JobError, match="cannot read"):
        run_job(spec(pair_dirs, tmp_path, input=str(tmp_path / "bad.parquet")), progress=False, log=quiet)
    write_input(tmp_path, PROMPTS[:3], keys=["a", "b", "a"])
    with pytest.raises(JobError, match="duplicate ids .*a"):
        run_job(spec(pair_dirs, tmp_path), progress=False, log=quiet)
    write_input(tmp_path)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(JobError, match="afile/out cannot be used: Not a directory"):
        run_job(spec(pair_dirs, tmp_path, output=str(tmp_path / "afile" / "out")), progress=False, log=quiet)
    with pytest.raises(JobError, match="no input files"):
        run_job(spec(pair_dirs, tmp_path, input=str(tmp_path / "missing*.parquet")), progress=False, log=quiet)
    assert not (tmp_path / "out" / "shards").exists() or os.listdir(tmp_path / "out" / "shards") == [".DS_Store"]


def test_models_changed_in_place_are_refused_on_resume(pair_dirs, tmp_path):
    """A model retrained into the same directory is another job: its finished shards came from
    the old weights."""
    import shutil
    from dynatree.jobs.plan import make_plan, prepare_output
    write_input(tmp_path)
    models = tmp_path / "models"
    shutil.copytree(pair_dirs, models)
    job = spec(pair_dirs, tmp_path, target=str(models / "target"), draft=str(models / "draft"))
    prepare_output(job, make_plan(job, quiet))
    (tmp_path / "out" / "shards" / "part-000000.parquet").write_text("a finished shard")
    prepare_output(job, make_plan(job, quiet))  # unchanged: resumes
    weights = next((models / "draft").glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    with pytest.raises(JobError, match=r"the models' files changed since .*\(draft model.safetensors: time "
                                       r"[0-9.]+ -> [0-9.]+: retrained.*touch -d @SECONDS FILE"):
        prepare_output(job, make_plan(job, quiet))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns - 10**9))  # (a restored copy)
    prepare_output(job, make_plan(job, quiet))  # resumes


def test_an_unwritable_shards_directory_stops_the_job_before_any_work(pair_dirs, tmp_path, monkeypatch):
    """out/shards made immutable (chattr +i) after a run began: the dry run refused it at once,
    the run only after Ray, the actors and a shard's decoding (the faults trial)."""
    from dynatree.jobs import plan as plan_module
    write_input(tmp_path)
    job = spec(pair_dirs, tmp_path)
    real = plan_module.ensure_writable

    def immutable_shards(directory, room=0):
        if directory.name == "shards":
            raise PermissionError(1, "Operation not permitted", str(directory / ".write-probe"))
        real(directory, room)

    monkeypatch.setattr(plan_module, "ensure_writable", immutable_shards)
    with pytest.raises(JobError, match="output directory .* is not writable: .*Operation not permitted"):
        plan_module.prepare_output(job, plan_module.make_plan(job, quiet))


def test_a_summary_that_cannot_be_written_leaves_no_temporary_file(tmp_path, monkeypatch):
    """The disk full as summary.json was written left an empty summary.tmp in the output (the
    faults trial); every file written whole-or-not (shards, manifest, summary, caches) now goes
    through machine.replaced, which removes its temporary file when the write fails."""
    from pathlib import Path

    from dynatree.jobs.summary import write_summary

    write_summary(tmp_path, {"rows": 1})
    real = Path.write_text

    def full(self, *a, **k):
        real(self, "")  # (what a full disk leaves: the file made, nothing in it)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OSError, match=f"cannot write {tmp_path / 'summary.json'}: No space left"):  # (named: the
        write_summary(tmp_path, {"rows": 2})  # corpus trial's ENOSPC said only pyarrow's words, no file)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
    assert json.loads((tmp_path / "summary.json").read_text()) == {"rows": 1}


def test_an_id_column_that_gained_duplicates_is_named_in_the_refusal(pair_dirs, tmp_path):
    """Without --id-column, an input whose id column gained duplicates (a file added to its
    directory) falls back to row indexes: the refusal named "changed: id_column", a flag the user
    never set (a data engineer's trial); it now says what the ids were and are."""
    import dataclasses
    from dynatree.jobs.plan import make_plan, prepare_output
    write_input(tmp_path)
    job = spec(pair_dirs, tmp_path, id_column="key")
    prepare_output(job, make_plan(job, quiet))
    (tmp_path / "out" / "shards" / "part-000000.parquet").write_text("a finished shard")
    rows = dataclasses.replace(job, id_column=None)
    with pytest.raises(JobError, match=r"changed: id_column: 'key' -> row indexes\)"):
        prepare_output(rows, make_plan(rows, quiet))


def test_a_job_from_before_absolute_paths_resumes(pair_dirs, tmp_path, monkeypatch):
    """Outputs written when the identity kept paths as typed (relative) resume under absolute
    paths: the old hash is this job's alias, its shards count as finished."""
    import dataclasses
    from dynatree.jobs.plan import finished_shards, make_plan, prepare_output, write_shard
    write_input(tmp_path)
    monkeypatch.chdir(tmp_path)
    job = spec(pair_dirs, tmp_path, input="in.parquet")
    legacy = dataclasses.replace(job, input="in.parquet", output="out")  # as an older version stored it
    old_plan = make_plan(legacy, quiet)
    prepare_output(legacy, old_plan)
    write_shard(tmp_path / "out", legacy, old_plan, 0, old_plan.schema.empty_table())
    assert job.input == str(tmp_path / "in.parquet") and job.identity_hash() != legacy.identity_hash()
    plan = make_plan(job, quiet)
    prepare_output(job, plan)
    assert finished_shards(tmp_path / "out", job, plan) == {0}
    with pytest.raises(JobError, match="changed: max_new_tokens"):  # a real change is still one
        other = spec(pair_dirs, tmp_path, input="in.parquet", max_new_tokens=5)
        prepare_output(other, make_plan(other, quiet))
    # a dtype spelled fp16 (kept as typed until 2026-11-30): its shards count in a dry run too, which
    # writes no manifest naming the old hash an alias (it said none was finished: the review)
    job = spec(pair_dirs, tmp_path, output=str(tmp_path / "out16"), dtype="float16")
    legacy = dataclasses.replace(job)
    object.__setattr__(legacy, "dtype", "fp16")  # (as the older version stored it)
    assert legacy.identity_hash() != job.identity_hash()
    old_plan = make_plan(legacy, quiet)
    prepare_output(legacy, old_plan)
    write_shard(tmp_path / "out16", legacy, old_plan, 0, old_plan.schema.empty_table())
    assert finished_shards(tmp_path / "out16", job, make_plan(job, quiet)) == {0}


def test_an_address_beside_an_initialized_ray_is_said_not_silently_ignored(ray_cluster, pair_dirs, tmp_path):
    """A Python caller that ray.init()-ed runs the job on that connection: an --address given too
    is not used, and the log says so."""
    write_input(tmp_path, PROMPTS[:2])
    said = []
    run_job(spec(pair_dirs, tmp_path, address="127.0.0.1:1", num_actors=1, verify_fraction=0.0, max_new_tokens=2),
            progress=False, log=said.append)
    assert any(m.startswith("note: Ray is already initialized in this process") and "not at --address 127.0.0.1:1"
               in m for m in said), said


def test_a_run_that_writes_no_shard_leaves_no_output_it_created(pair_dirs, tmp_path, monkeypatch):
    """A run that fails before any shard (a cluster it cannot reach: a typo in --address; actors
    that never load) takes the output directory it created with it; one that existed before stays.
    (The failure is injected where the actors would start: in this test process Ray may be up.)"""
    from dynatree.jobs import driver

    def unreachable(self, todo, progress):
        raise JobError("cannot reach the Ray cluster at 127.0.0.1:1: nothing answers there")

    monkeypatch.setattr(driver._Dispatch, "run", unreachable)
    write_input(tmp_path)
    job = spec(pair_dirs, tmp_path)
    with pytest.raises(JobError, match="nothing answers"):
        run_job(job, progress=False, log=quiet)
    assert not (tmp_path / "out").exists()
    (tmp_path / "out").mkdir()  # there before the run: kept (as what a user put in it would be)
    with pytest.raises(JobError, match="nothing answers"):
        run_job(job, progress=False, log=quiet)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".dynatree.lock", "manifest.json", "runs.jsonl",
                                                                    "shards"]  # (the run's record: how it failed)
    shutil.rmtree(tmp_path / "out")  # a failure before shards/ was made (a full disk): the lock went too

    def full(spec, plan):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(driver, "prepare_output", full)
    with pytest.raises(OSError, match="No space left"):
        run_job(job, progress=False, log=quiet)
    assert not (tmp_path / "out").exists()  # (it kept an empty .dynatree.lock: the faults trial)
    out = tmp_path / "out"  # one that wrote a shard, ended by a signal: kept whole, its manifest too
    (out / "shards").mkdir(parents=True)
    for f in ("manifest.json", ".dynatree.lock", "shards/part-000000.parquet"):
        (out / f).write_text("")
    driver._remove_unused(out)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [
        ".dynatree.lock", "manifest.json", "shards", "shards/part-000000.parquet"]


def test_an_address_where_nothing_listens_fails_fast(monkeypatch):
    """ray.init would retry such an address for minutes (the driver probes it before ray.init;
    called directly here: in this test process Ray may already be up) -- `auto` included, which
    names the cluster the last `ray start` recorded (ray.init waited ~10 minutes, deaf to Ctrl-C,
    on a recorded head that had died), or RAY_ADDRESS's."""
    import socket
    import ray._private.services
    from dynatree.jobs.driver import _probe
    with socket.socket() as s:  # a free port, closed again: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.time()
    with pytest.raises(JobError, match=f"cannot reach the Ray cluster at 127.0.0.1:{port}: nothing answers"):
        _probe(f"127.0.0.1:{port}")
    with pytest.raises(JobError, match="nothing answers .*Ray client server address"):  # a Ray client address alike
        _probe(f"ray://127.0.0.1:{port}")
    with pytest.raises(JobError, match=r"at 127.0.0.1:\d+ \(from RAY_ADDRESS: unset it to run on this machine\)"):
        _probe(f"127.0.0.1:{port}", "RAY_ADDRESS")  # (a stale RAY_ADDRESS was not named: trial AM)
    assert time.time() - t0 < 30
    import http.server
    import threading
    web = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # a dashboard's port, say
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        addr = f"127.0.0.1:{web.server_port}"
        with pytest.raises(JobError, match=f"{addr} answers as a web server, not as a Ray cluster .*dashboard"):
            _probe(addr)
        _probe(f"ray://{addr}")  # (a client port may sit behind an HTTPS ingress: left to ray.init)
        monkeypatch.setenv("RAY_USE_TLS", "1")  # (a TLS GCS is not asked in plain bytes)
        _probe(addr)
        monkeypatch.delenv("RAY_USE_TLS")
    finally:
        web.shutdown()
    import grpc  # (Ray's own dependency) a gRPC server, as a GCS is, passes the probe
    from concurrent.futures import ThreadPoolExecutor
    server = grpc.server(ThreadPoolExecutor(1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        _probe(f"127.0.0.1:{port}")
    finally:
        server.stop(None)
    with pytest.raises(JobError, match="--address http://127.0.0.1:8265 is an HTTP address .*give the head's GCS address"):
        _probe("http://127.0.0.1:8265")  # (Ray's message blamed RAY_ADDRESS)
    with pytest.raises(JobError, match="RAY_ADDRESS http://127.0.0.1:8265 .*or unset RAY_ADDRESS to run on this machine"):
        _probe("http://127.0.0.1:8265", "RAY_ADDRESS")  # (as Ray's Jobs docs have users export it)
    with pytest.raises(JobError, match="^RAY_ADDRESS localhost: give the head's GCS address, HOST:PORT"):
        _probe("localhost", "RAY_ADDRESS")
    with socket.socket() as s:  # something listening: no error
        s.bind(("127.0.0.1", 0))
        s.listen()
        _probe(f"127.0.0.1:{s.getsockname()[1]}")
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        monkeypatch.setattr(ray._private.services, "find_gcs_addresses", lambda: [])  # (no GCS process here)
        monkeypatch.setattr(ray._private.services, "find_bootstrap_address", lambda _: f"127.0.0.1:{s.getsockname()[1]}")
        _probe("auto")
        live = f"127.0.0.1:{s.getsockname()[1]}"  # a dead record beside one running GCS: Ray would take the GCS
        monkeypatch.setattr(ray._private.services, "find_gcs_addresses", lambda: [live])  # (another job's own
        monkeypatch.setattr(ray._private.services, "find_bootstrap_address", lambda _: f"127.0.0.1:{port}")
        with pytest.raises(JobError, match=f"auto: Ray would attach to {live}, a cluster it finds running on this "
                                           f"machine, not a head `ray start` recorded here \\(its record names "
                                           f"127.0.0.1:{port}, which does not answer\\)"):
            _probe("auto")  # (cluster, say: the concurrent-jobs trial's job died when that job ended)
        monkeypatch.setattr(ray._private.services, "find_bootstrap_address", lambda _: None)
        with pytest.raises(JobError, match=f"auto: Ray would attach to {live}, .* recorded here -- another job's"):
            _probe("auto")
    monkeypatch.setattr(ray._private.services, "find_gcs_addresses", lambda: [])
    monkeypatch.setattr(ray._private.services, "find_bootstrap_address", lambda _: f"127.0.0.1:{port}")
    with pytest.raises(JobError, match=f"at 127.0.0.1:{port}, which `auto` means here \\(the cluster the last `ray "
                                       "start` on this machine recorded; `ray stop` clears a stale record\\)"):
        _probe("auto")
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    with pytest.raises(JobError, match=r"which `auto` means here \(RAY_ADDRESS\)"):
        _probe("auto")
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setattr(ray._private.services, "find_bootstrap_address", lambda _: None)
    _probe("auto")  # nothing recorded: ray.init decides


def test_spec_validation_messages(tmp_path):
    with pytest.raises(SpecError, match=r"missing required field\(s\): output \(on the command line --output\)"):
        build_spec(None, input="x")
    with pytest.raises(SpecError, match="verify_fraction"):
        build_spec(None, input="x", output="y", verify_fraction=2)
    with pytest.raises(SpecError, match="batch_size must be a number or auto"):
        build_spec(None, input="x", output="y", batch_size="many")
    assert build_spec(None, input="x", output="y", batch_size="8").batch_size == 8
    assert build_spec(None, input="x", output="y", batch_size="AUTO").batch_size == "auto"
    (tmp_path / "in.parquet").write_text("")  # the same file typed two ways is the same job (resume)
    here = os.getcwd()
    try:
        os.chdir(tmp_path)
        a = build_spec(None, input="./in.parquet", output="y")
    finally:
        os.chdir(here)
    assert a.identity_hash() == build_spec(None, input=str(tmp_path / "in.parquet"), output="y").identity_hash()
    with pytest.raises(SpecError, match="use device cuda"):
        build_spec(None, input="x", output="y", device="cuda:1")
    with pytest.raises(SpecError, match="device must be auto, cpu, cuda or cuda:N"):
        build_spec(None, input="x", output="y", device="gpu")
    with pytest.raises(SpecError, match="gpus_per_actor must be within"):
        build_spec(None, input="x", output="y", gpus_per_actor=2)
    assert build_spec(None, input="x", output="y", device="cuda:0", gpus_per_actor=0.5).gpus_per_actor == 0.5
    with pytest.raises(SpecError, match="device cuda with gpus_per_actor 0"):
        build_spec(None, input="x", output="y", device="cuda", gpus_per_actor=0)
    assert build_spec(None, input="x", output="y", device="auto", gpus_per_actor=0).gpus_per_actor == 0
    for field, value in (("cpus_per_actor", float("inf")), ("memory_per_actor", float("nan")),
                         ("prefix_cache_gb", float("nan")), ("cpus_per_actor", float("nan"))):
        with pytest.raises(SpecError, match=f"{field} must be a finite number"):  # (nan passes comparisons)
            build_spec(None, input="x", output="y", **{field: value})
    with pytest.raises(SpecError, match="names no column: give column names, or none"):
        build_spec(None, input="x", output="y", keep_columns=" , ")
    job = tmp_path / "job.yaml"  # a job file's options: a mapping, or KEY=VALUE strings as the flag takes them
    for options, want in (("{d_max: 6}", {"d_max": 6}), ("[d_max=6, tau=0.1]", {"d_max": 6, "tau": 0.1})):
        job.write_text(f"input: x\noutput: y\noptions: {options}\n")
        assert build_spec(str(job)).options == want
    for options, said in (("[d_max]", "options: option 'd_max' is not of the form key=value"),
                          ("5", "options must be a mapping KEY: VALUE .* got int 5"),
                          ("[[d_max, 6]]", "options must be a mapping .* got list \\[\\['d_max', 6\\]\\]")):
        job.write_text(f"input: x\noutput: y\noptions: {options}\n")
        with pytest.raises(SpecError, match=said):
            build_spec(str(job))
    assert build_spec(None, input="x", output="y", keep_columns="None").keep_columns == ()
    # an output path as the shell would read it, from a job file too (a literal ./~ once received
    # the manifest while the shards went to the home directory)
    for name, text in (("dup.yaml", "input: x\noutput: y\nmethod: ar\nmethod: linear\n"),
                       ("dup.json", '{"input": "x", "output": "y", "method": "ar", "method": "linear"}')):
        (tmp_path / name).write_text(text)  # a field twice: an error, not the last one silently
        with pytest.raises(SpecError, match="method given twice"):
            build_spec(str(tmp_path / name))
    job.write_text("input: x\noutput: y\noptions: {<<: {d_max: 6}, d_max: 7}\n")  # (a merge key's field
    assert build_spec(str(job)).options == {"d_max": 7}  # overridden is no repeat)
    job.write_text("input: x\noutput: ~/dt-out\n")
    assert build_spec(str(job)).output == os.path.join(os.path.expanduser("~"), "dt-out")
    assert build_spec(None, input="x", output="y").output == "y"  # (summary.json names it in full)
    with pytest.raises(SpecError, match="placement_timeout_s must be > 0"):
        build_spec(None, input="x", output="y", placement_timeout_s=-5.0)
    with pytest.raises(SpecError, match="give both target and draft, or neither.*ar needs only a target"):
        build_spec(None, input="x", output="y", method="ar", draft="d")  # (ran ar on the demo target)
    assert build_spec(None, input="x", output="y", method="ar", target="t").draft is None
    with pytest.raises(SpecError, match="method dynatree needs a draft: add --draft, or run --method ar with a target"):
        build_spec(None, input="x", output="y", target="t")  # (it read "give both ..., or neither; a target alone ...")
    with pytest.raises(SpecError, match="no option 'depth'"):
        build_spec(None, input="x", output="y", options={"depth": "3"})
    job = tmp_path / "job.yaml"
    job.write_text("input: a.parquet\noutput: out\nmethod: fixed_tree\noptions: {depth: 3}\nbogus: 1\n")
    with pytest.raises(SpecError, match="unknown job field.*bogus"):
        build_spec(str(job))
    job.write_text("input: a.parquet\noutput: out\nmax_new_token: 8\noptions: {dmax: 3}\n")  # typos: named
    with pytest.raises(SpecError, match=r"unknown job field\(s\): max_new_token \(did you mean max_new_tokens\?\)"):
        build_spec(str(job))
    with pytest.raises(SpecError, match=r"has no option 'dmax' \(did you mean d_max\?\)"):
        build_spec(None, input="x", output="y", options={"dmax": 3})
    with pytest.raises(SpecError, match=r"unknown job field\(s\): max_new_token"):  # (a Python caller's keyword)
        build_spec(None, input="x", output="y", max_new_token=3)
    # a flag's spelling, a command-line-only flag, an empty value, a no-op gate, a kernel typo (trial AM)
    for fields, said in (({"resource": {"a": 1}}, r"resource is spelt resources_per_actor in a job file"),
                         ({"resources": {"a": 1}}, r"resources is spelt resources_per_actor"),
                         ({"dry_run": True}, r"dry_run is a command-line flag \(--dry-run\), not a job field"),
                         ({"id_column": ""}, r"id_column is empty \(an unset shell variable\?\)"),
                         ({"target": "", "draft": "d"}, r"target is empty \(an unset shell variable\?\)[^;]*$"),
                         ({"fail_on_mismatch": True}, r"verify_fraction is 0: no row would be checked"),
                         ({"kernel": "lean_bf16"}, r"got 'lean_bf16' \(did you mean lean-bf16\?\)")):
        with pytest.raises(SpecError, match=said):
            build_spec(None, input="x", output="y", **fields)
    assert build_spec(None, input="x", output="y", fail_on_mismatch=True, verify_fraction=0.1).fail_on_mismatch
    for bad in ({"method": 3}, {"options": {1: 2}}):  # (no spelling to suggest: the plain error, no traceback)
        with pytest.raises(SpecError, match="unknown method 3|has no option 1"):
            build_spec(None, input="x", output="y", **bad)
    for name in ("job.YAML", "jobfile"):  # (read as JSON, refused with "Expecting value")
        (tmp_path / name).write_text("input: a.parquet\noutput: out\n")
        assert build_spec(str(tmp_path / name)).output == "out"
    (tmp_path / "job.json").write_text("input: a.parquet\n")
    with pytest.raises(SpecError, match=r"cannot parse job file .*job.json \(read as JSON\)"):
        build_spec(str(tmp_path / "job.json"))
    (tmp_path / "bom.json").write_bytes(b'\xef\xbb\xbf{"input": "a.parquet", "output": "out"}')  # (Notepad's)
    assert build_spec(str(tmp_path / "bom.json")).output == "out"
    for text, said in ((b"1: foo\n", "a field name 1 is not a name"), (b"~: foo\n", "a field name None is not"),
                       (b"a: \xff\n", "is not UTF-8 text"),  # (these three were tracebacks or named no file)
                       (b"keep_columns: [1, null]\n", r"keep_columns must be column names, got \[1, None\]"),
                       (b"keep_columns: [[a]]\n", r"keep_columns must be column names"),
                       (b"max_new_tokens: [" + b"1, " * 5000 + b"1]\n", r"max_new_tokens must be int, got \[1, 1, 1, 1, 1, 1, \.\.\.\]")):
        (tmp_path / "odd.yaml").write_bytes(text)
        with pytest.raises(SpecError, match=said):
            build_spec(str(tmp_path / "odd.yaml"), input="x", output="y")
    job.write_text("input: a.parquet\noutput: out\nmethod: fixed_tree\noptions: {depth: 3}\n")
    a = build_spec(str(job))
    b = build_spec(str(job), options={"depth": "3"})
    assert a.identity_hash() == b.identity_hash() and a.options == {"depth": 3}
    # top_k/top_p/seed change nothing at temperature 0 (said so on every command): the same job, a
    # job of an older version that counted them resumes (its options re-read: plan._legacy)
    from dynatree.jobs.plan import _legacy, _same_identity
    greedy = build_spec(str(job), options={"depth": 3, "top_k": 4, "top_p": 0.5, "seed": 7, "kv_sinks": 8})
    assert greedy.identity_hash() == a.identity_hash() and greedy.identity()["options"] == {"depth": 3}
    older = {"identity_hash": "0123456789abcdef", "identity": {**a.identity(), "options": {"depth": 3, "top_k": 4}}}
    now = {"identity_hash": a.identity_hash(), "identity": a.identity()}
    assert _same_identity(_legacy(older), now)
    sampled = build_spec(str(job), options={"depth": 3, "temperature": 0.8})
    assert sampled.identity_hash() != build_spec(str(job), options={"depth": 3, "temperature": 0.8, "top_k": 4}
                                                 ).identity_hash()
    for bad, msg in (({"max_new_tokens": "16"}, "max_new_tokens must be int, got '16'"),
                     ({"verify_fraction": "0.5"}, "verify_fraction must be float"),
                     ({"shard_size": 2.5}, "shard_size must be int"), ({"max_prompt_tokens": True}, "max_prompt_tokens"),
                     ({"method": "linear", "options": {"k": 3.7}}, "option k: expected int")):
        job.write_text(yaml.safe_dump({"input": "a.parquet", "output": "out", **bad}))  # as a job file gives them
        with pytest.raises(SpecError, match=msg):
            build_spec(str(job))


def test_a_jobs_dtype_is_checked_and_named_one_way(tmp_path):
    """A job file's dtype was not checked (half failed in the actors, 28 s in), and an alias (fp16)
    ran without the slow-dtype warning, refused lean-bf16 with fp32 and did not resume as float16
    (the precision trial)."""
    from dynatree.jobs.plan import _legacy

    with pytest.raises(SpecError, match="dtype must be one of float32, bfloat16, float16, float64 .* got 'half'"):
        build_spec(None, input="x", output="y", dtype="half")
    a = build_spec(None, input="x", output="y", dtype="fp16", options={"kv_dtype": "bf16"})
    b = build_spec(None, input="x", output="y", dtype="float16", options={"kv_dtype": "bfloat16"})
    assert a.dtype == "float16" and a.identity_hash() == b.identity_hash()
    assert build_spec(None, input="x", output="y", dtype="fp32", kernel="lean-bf16").dtype == "float32"
    assert _legacy({"identity": {"dtype": "fp16"}})["identity"]["dtype"] == "float16"  # (written as typed)


def test_a_job_files_relative_path_found_elsewhere_says_where_to_run(tmp_path, monkeypatch):
    """Relative paths in a job file are read from where dynatree runs; one missing from there but
    found from the file's directory or above it is named with where to run (the error named only the
    missing path); from there, or given by a flag, the same file is fine."""
    (tmp_path / "jobs").mkdir()
    (tmp_path / "data.jsonl").write_text('{"text": "hi"}\n')
    job = tmp_path / "jobs" / "job.yaml"
    job.write_text("input: data.jsonl\noutput: out\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.raises(SpecError, match=f"input 'data.jsonl' of .*job.yaml is not found from here .*run from {tmp_path}"):
        build_spec(str(job))
    assert build_spec(str(job), input=str(tmp_path / "data.jsonl")).input == str(tmp_path / "data.jsonl")
    monkeypatch.chdir(tmp_path)
    assert build_spec(str(job)).input == str(tmp_path / "data.jsonl")
    # a bundled example runs from anywhere (an installed wheel's advice was to run inside site-packages)
    from dynatree.jobs.spec import _EXAMPLES
    monkeypatch.chdir(tmp_path / "elsewhere")
    demo = build_spec(str(_EXAMPLES / "demo.yaml"))
    assert demo.input == str(_EXAMPLES / "demo-prompts.jsonl") and demo.output == "out/demo"  # (output: from here)


def test_context_overflow_truncates_or_errors(ray_cluster, pair_dirs, tmp_path):
    long_text = " ".join(PROMPTS * 12)  # far more tokens than the 128-token context
    write_input(tmp_path, [long_text, "short one"])
    run_job(spec(pair_dirs, tmp_path, max_new_tokens=20, max_prompt_tokens=None, num_actors=1),
            progress=False, log=quiet)
    rows = read_rows(tmp_path / "out")
    assert rows[0]["error"] is None and rows[0]["prompt_tokens"] == 128 - 20
    assert rows[0]["num_generated_tokens"] <= 20 and rows[0]["matches_ar"] is True
    with pytest.raises(JobError, match="--max-new-tokens 200 leaves no room"):  # every row would fail: none start
        run_job(spec(pair_dirs, tmp_path, max_new_tokens=200, num_actors=1, overwrite=True), progress=False, log=quiet)


def test_windowed_job_generates_past_the_context(ray_cluster, pair_dirs, tmp_path):
    """kv_window (StreamingLLM): a prompt longer than the context and 200 new tokens past the
    128-token context; every row checked against ar with the same window."""
    long_text = " ".join(PROMPTS * 12)
    write_input(tmp_path, [long_text, "short one"])
    run_job(spec(pair_dirs, tmp_path, max_new_tokens=200, max_prompt_tokens=None, num_actors=1, ignore_eos=True,
                 options={"kv_window": 48, "kv_evict": 8}), progress=False, log=quiet)
    rows = read_rows(tmp_path / "out")
    assert all(r["error"] is None and r["num_generated_tokens"] == 200 and r["matches_ar"] is True for r in rows)
    assert rows[0]["prompt_tokens"] > 128


def test_custom_resources_per_actor_from_flags_files_and_callers(pair_dirs, tmp_path, monkeypatch):
    """--resource KEY=N (repeatable), a job file's mapping or list, a caller's dict: one typed mapping,
    not part of the job's identity; Ray's own resources and bad amounts refused; a local job (no
    --address: a cluster without custom resources) says no node offers it, before Ray starts."""
    from click.testing import CliRunner

    from dynatree.cli import main

    base = dict(input="x", output="y")
    assert build_spec(None, **base, resources_per_actor=("fast=1", "disk=0.5")).resources_per_actor == \
        {"fast": 1.0, "disk": 0.5}
    job = tmp_path / "job.yaml"
    job.write_text("input: x\noutput: y\nresources_per_actor: {fast: 2}\n")
    assert build_spec(str(job)).resources_per_actor == {"fast": 2}
    assert build_spec(str(job), resources_per_actor=None).resources_per_actor == {"fast": 2}  # (no flag given)
    assert build_spec(None, **base, resources_per_actor={"fast": 1}).identity_hash() == \
        build_spec(None, **base).identity_hash()  # (where actors run changes no output)
    job.write_text("input: x\noutput: y\nresources_per_actor:\n")  # (left empty: none)
    assert build_spec(str(job)).resources_per_actor == {}
    for bad, said in ((("CPU=2",), "resources_per_actor CPU: give it as --cpus-per-actor (cpus_per_actor in a job "
                                   "file)"),
                      (("fast=-1",), "resources_per_actor fast: the amount must be a number of at least 0.0001 "
                                     "(Ray's resolution), got -1.0"),
                      (("fast=0.00001",), "got 1e-05"),  # (it divided by zero in placement)
                      (("object_store_memory=1",), "Ray's object store is no resource an actor can reserve"),
                      (("fast=lots",), "the amount must be a number of at least 0.0001 (Ray's resolution), got 'lots'"),
                      (("fast",), "option 'fast' is not of the form key=value")):
        with pytest.raises(SpecError, match=re.escape(said)):
            build_spec(None, **base, resources_per_actor=bad)
    write_input(tmp_path)
    import ray  # (as a fresh `dynatree run` process: no cluster of this test session's to defer to)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    res = CliRunner().invoke(main, ["run", "--input", str(tmp_path / "in.parquet"), "--output", str(tmp_path / "out"),
                                    "--target", str(pair_dirs / "target"), "--draft", str(pair_dirs / "draft"),
                                    "--max-new-tokens", "4", "--cpus-per-actor", "1", "--resource", "fast=1", "--dry-run"])
    assert res.exit_code == 1 and "no node offers fast" in res.output and "node this machine (no --address: the job " \
        "runs here)" in res.output, res.output


def test_a_replacement_no_node_can_hold_is_said_while_it_waits(tmp_path):
    """The only node offering a --resource lost: its actor's replacement waited two minutes in silence
    and then failed "its node lost, or no room" (the resource trial).  It is said once, at once, with
    the placement check's words, while the wait goes on (a node joining in time still takes it)."""
    import time
    from types import SimpleNamespace

    from dynatree.jobs import driver as job_driver

    d = job_driver._Dispatch.__new__(job_driver._Dispatch)
    said = []
    d.spec = build_spec(None, input="x", output="y", resources_per_actor={"fast": 1})
    d.cpus, d.gpus, d.memory, d.log = 1.0, 0.0, None, said.append
    d.unplaceable, d.next_node_check = {}, 0.0
    left = [{"NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 2}, "Alive": True},
            {"NodeManagerAddress": "10.0.0.3", "Resources": {"CPU": 1, "fast": 1}, "Alive": False}]
    fake = SimpleNamespace(nodes=lambda: left)
    d._say_unplaceable(fake, 0, time.time() + 100)
    d._say_unplaceable(fake, 0, time.time() + 100)
    assert len(said) == 1 and said[0].startswith("actor 0's replacement waits: cannot place 1 actor(s) × {CPU: 1, "
                                                 "GPU: 0, fast: 1}") and "no node offers fast" in said[0]
    assert "until a node that can hold it joins, or 100 s more" in said[0] or "or 99 s more" in said[0]
    left[1]["Alive"] = True  # (a node that holds it: nothing said)
    d.unplaceable, d.next_node_check = {}, 0.0
    d._say_unplaceable(fake, 1, time.time() + 100)
    assert len(said) == 1


def test_command_line_usage_errors_and_unsetting_a_job_files_value(tmp_path, monkeypatch):
    """A bad flag or job file exits 2 as click's own usage errors do (it was 1, a failed job's);
    `--limit none` unsets a job file's limit (no flag value could: trial AM); --device is checked as
    --dtype is; generate --help's method options are on run's, check's and bench's too."""
    from click.testing import CliRunner

    from dynatree import cli
    from dynatree.jobs import driver

    job = tmp_path / "job.yaml"
    job.write_text(f"input: {tmp_path / 'in.parquet'}\noutput: {tmp_path / 'out'}\nlimit: 2\nmax_prompt_tokens: 20\n")
    got = []
    monkeypatch.setattr(driver, "run_job", lambda spec, **k: got.append(spec) or {"options": {}})  # (a dry run)
    res = CliRunner().invoke(cli.main, ["run", "--config", str(job), "--limit", "none", "--max-prompt-tokens", "None",
                                        "--dry-run"])
    assert res.exit_code == 0 and (got[0].limit, got[0].max_prompt_tokens) == (None, None), res.output
    CliRunner().invoke(cli.main, ["run", "--config", str(job), "--dry-run"])
    assert (got[1].limit, got[1].max_prompt_tokens) == (2, 20)
    res = CliRunner().invoke(cli.main, ["run", "--config", str(job), "--max-new-tokens", "0"])
    assert res.exit_code == 2 and "max_new_tokens must be >= 1" in res.output and "Usage: " in res.output, res.output
    res = CliRunner().invoke(cli.main, ["generate", "--device", "gpu", "--prompt", "x"])
    assert res.exit_code == 2 and "choose auto, cpu, cuda or cuda:N, not 'gpu'" in res.output, res.output
    for command in ("run", "check", "bench", "generate"):
        assert "Method options (--option key=value)" in CliRunner().invoke(cli.main, [command, "--help"]).output

    def read_only(spec, **k):
        raise OSError(30, "Read-only file system")
    monkeypatch.setattr(driver, "run_job", read_only)  # (a fault that stays: "the same command resumes" alone, trial AK)
    res = CliRunner().invoke(cli.main, ["run", "--config", str(job)])
    assert res.exit_code == 1 and "Read-only file system; once that is fixed -- " in res.output, res.output


def test_example_job_files_are_valid_specs():
    from pathlib import Path
    for f in sorted((Path(__file__).resolve().parents[1] / "jobs" / "examples").glob("*.yaml")):
        spec = build_spec(str(f))
        assert spec.input and spec.output and spec.method


def test_sampled_job_reproducible_per_row(ray_cluster, pair_dirs, tmp_path):
    """temperature > 0: each row's sample depends on (seed, id) only, so a different sharding,
    actor count and method reproduce it; the AR check compares it with ar drawing with the row's seed."""
    write_input(tmp_path)
    opts = {"temperature": 0.9, "seed": 5}
    run_job(spec(pair_dirs, tmp_path, options=opts), progress=False, log=quiet)
    a = read_rows(tmp_path / "out")
    run_job(spec(pair_dirs, tmp_path, options=opts, output=str(tmp_path / "out2"), shard_size=5,
                 num_actors=1, method="linear"), progress=False, log=quiet)
    b = read_rows(tmp_path / "out2")
    assert [r["generated_token_ids"] for r in a] == [r["generated_token_ids"] for r in b]
    assert all(r["error"] is None and r["matches_ar"] in (True, None) for r in a + b)
    assert any(r["matches_ar"] for r in a + b)
    assert len({tuple(r["generated_token_ids"]) for r in a}) > 1


def test_samples_per_prompt(ray_cluster, pair_dirs, tmp_path):
    """samples=3: three output rows per prompt, numbered, each with its own seed (sample 0 is the
    row a 1-sample job draws), kept columns repeated, a bad prompt's samples all errors; the
    samples share the prompt's prefill; a resume redoes a lost shard's samples exactly."""
    header = "Call me Ishmael. Some years ago, never mind how long precisely. Call me Ishmael. "  # ~72 tokens
    texts = [header + PROMPTS[0], *PROMPTS[1:5], None]
    keys = [f"k{i}" for i in range(len(texts))]
    pq.write_table(pa.table({"key": keys, "text": texts, "topic": [f"t{i}" for i in keys]}), tmp_path / "in.parquet")
    opts = {"temperature": 0.9, "seed": 5}
    s = run_job(spec(pair_dirs, tmp_path, options=opts, samples=3, num_actors=1, batch_size=8), progress=False,
                log=quiet)
    rows = read_rows(tmp_path / "out")
    assert [(r["id"], r["sample"], r["topic"]) for r in rows] == [(k, j, f"t{k}") for k in keys for j in range(3)]
    good, bad = rows[:-3], rows[-3:]
    assert all(r["error"] is None and r["matches_ar"] is True for r in good)
    assert all("null" in r["error"] for r in bad) and s["rows"] == 18 and s["errors"] == 3
    from dynatree.jobs.summary import format_table
    assert "18  (6 prompts x 3 samples; errors 3)" in format_table(s)
    assert s["equivalence"]["checked"] == 15 and s["equivalence"]["mismatches"] == 0
    assert "matches ar               15/15 (against ar_t0.9, each row's own seed)" in format_table(s)  # (not ar's)
    draws = [{tuple(r["generated_token_ids"]) for r in good[i:i + 3]} for i in range(0, 15, 3)]
    assert sum(len(d) > 1 for d in draws) >= 3  # a prompt's samples differ
    assert sum(r["cached_prompt_tokens"] for r in good[:3]) >= 64  # the long prompt computed once
    one = run_job(spec(pair_dirs, tmp_path, options=opts, output=str(tmp_path / "one"), method="linear",
                       verify_fraction=0.0), progress=False, log=quiet)
    assert one["rows"] == len(texts) and "sample" not in pq.read_schema(tmp_path / "one/shards/part-000000.parquet").names
    assert [r["generated_token_ids"] for r in read_rows(tmp_path / "one")][:-1] == \
        [r["generated_token_ids"] for r in good if r["sample"] == 0]
    os.remove(tmp_path / "out/shards/part-000001.parquet")
    again = run_job(spec(pair_dirs, tmp_path, options=opts, samples=3, num_actors=1, batch_size=3),
                    progress=False, log=quiet)
    assert again["this_run"]["shards_this_run"] == 1
    def same(rs):  # what a resume must reproduce (timings differ)
        return [(r["id"], r["sample"], r["topic"], r["generated_token_ids"]) for r in rs]
    assert same(read_rows(tmp_path / "out")) == same(rows)
    with pytest.raises(SpecError, match="samples=2 needs sampling"):
        spec(pair_dirs, tmp_path, samples=2)
    with pytest.raises(SpecError, match="samples=2 needs sampling"):  # top_k = 1 draws the argmax
        spec(pair_dirs, tmp_path, samples=2, options={"temperature": 0.9, "top_k": 1})


def test_a_sample_seed_is_not_another_rows():
    """Ids may hold any character: (id "q", sample 1) must not draw with (id "q:1", sample 0)'s seed."""
    from dynatree.actors.worker import row_seed
    assert row_seed(5, "q", 1) != row_seed(5, "q:1", 0) and row_seed(5, "q", 0) == row_seed(5, "q")
    seeds = {row_seed(5, i, k) for i in ("q", "q:1", "q:0", '["q", 1]') for k in range(3)}
    assert len(seeds) == 12
    # 64-bit seeds, as the seed option's: rows with one prompt (a template, --samples) must not
    # repeat a sample by a seed collision (32 bits: two of 10,000 about once in a hundred jobs)
    seeds = [row_seed(0, i, k) for i in range(200) for k in range(2)]
    assert max(seeds) < 2 ** 64 and sum(s >= 2 ** 32 for s in seeds) > 390


def test_limit_is_a_trial_run_of_the_first_rows(ray_cluster, pair_dirs, tmp_path):
    """--limit N: the input's first N rows only; the whole job on the same output is another job
    (refused), so a trial's short last shard never stands in for a whole one."""
    write_input(tmp_path)
    s = run_job(spec(pair_dirs, tmp_path, limit=5, verify_fraction=0.0, max_new_tokens=3, num_actors=1),
                progress=False, log=quiet)
    assert s["rows"] == 5 and [r["id"] for r in read_rows(tmp_path / "out")] == [f"k{i}" for i in range(5)]
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["rows"] == 5
    with pytest.raises(JobError, match="different config .*limit"):
        run_job(spec(pair_dirs, tmp_path, verify_fraction=0.0, max_new_tokens=3, num_actors=1), progress=False, log=quiet)
    s = run_job(spec(pair_dirs, tmp_path, limit=50, verify_fraction=0.0, max_new_tokens=3, num_actors=1,
                     overwrite=True), progress=False, log=quiet)
    assert s["rows"] == len(PROMPTS)  # a limit past the input's end takes it all
    with pytest.raises(SpecError, match="limit must be >= 1"):
        spec(pair_dirs, tmp_path, limit=0)


def test_driver_refuses_strays_and_bad_values_before_work(ray_cluster, pair_dirs, tmp_path):
    """A shard file numbered past the job's shards would be read and counted as output: refused. A
    stop token id past the vocabulary, or a cache window past the context, of the bundled demo pair
    too, fail in the driver; a column kept twice is kept once."""
    import shutil

    write_input(tmp_path)
    run_job(spec(pair_dirs, tmp_path, verify_fraction=0.0, max_new_tokens=2, num_actors=1), progress=False, log=quiet)
    shards = tmp_path / "out" / "shards"
    shutil.copy(shards / "part-000000.parquet", shards / "part-000099.parquet")
    with pytest.raises(JobError, match="part-000099.parquet; it has 3 shards"):
        run_job(spec(pair_dirs, tmp_path, verify_fraction=0.0, max_new_tokens=2, num_actors=1), progress=False,
                log=quiet)
    demo = dict(target=None, draft=None, output=str(tmp_path / "o2"), address="127.0.0.1:1")  # never reached
    with pytest.raises(JobError, match="stop-token-id 99999 is outside"):
        run_job(spec(pair_dirs, tmp_path, stop_token_ids=(99999,), **demo), progress=False, log=quiet)
    with pytest.raises(JobError, match="kv_window 5000"):
        run_job(spec(pair_dirs, tmp_path, options={"kv_window": 5000}, **demo), progress=False, log=quiet)
    assert spec(pair_dirs, tmp_path, keep_columns="text,key,text").keep_columns == ("text", "key")


def test_changed_input_resume_is_refused(ray_cluster, pair_dirs, tmp_path):
    """Defect: the same path with other contents must not resume into lost and duplicated ids."""
    write_input(tmp_path)
    run_job(spec(pair_dirs, tmp_path, verify_fraction=0.0, max_new_tokens=4), progress=False, log=quiet)
    for f in sorted(os.listdir(tmp_path / "out" / "shards"))[:2]:
        os.remove(tmp_path / "out" / "shards" / f)
    write_input(tmp_path, PROMPTS[::-1], keys=[f"k{i}" for i in range(len(PROMPTS))][::-1])
    with pytest.raises(JobError, match="input .* changed since"):
        run_job(spec(pair_dirs, tmp_path, verify_fraction=0.0, max_new_tokens=4), progress=False, log=quiet)
    s = run_job(spec(pair_dirs, tmp_path, verify_fraction=0.0, max_new_tokens=4, overwrite=True), progress=False,
                log=quiet)
    ids = [r["id"] for r in read_rows(tmp_path / "out")]
    assert s["rows"] == len(PROMPTS) and sorted(ids) == sorted(set(ids)) and ids[0] == f"k{len(PROMPTS) - 1}"


def test_a_changed_input_is_refused_before_its_scan_naming_the_file(tmp_path, monkeypatch):
    """A 1 GB JSONL input with a line appended was refused only after a silent 166 s re-scan, and
    the refusal named no file of the five (the corpus trial): the manifest's sizes and times are
    compared first, and the message says which file changed and how."""
    from dynatree.data import InputSource
    from dynatree.jobs import plan

    (tmp_path / "in").mkdir()
    for name in ("a", "b"):
        (tmp_path / "in" / f"{name}.jsonl").write_text("".join(json.dumps({"text": f"{name} {i}"}) + "\n" for i in range(3)))
    job = build_spec(None, input=str(tmp_path / "in"), output=str(tmp_path / "out"), method="ar", target="t")
    (tmp_path / "out" / "shards").mkdir(parents=True)
    (tmp_path / "out" / "shards" / "part-000000.parquet").write_bytes(b"")
    fp = InputSource.open(job.input).fingerprint()
    (tmp_path / "out" / "manifest.json").write_text(json.dumps({"identity": job.identity(), "input_fingerprint": fp,
                                                                "identity_hash": job.identity_hash()}))
    plan.refuse_changed_input_early(job)  # unchanged: nothing said
    monkeypatch.setattr(InputSource, "open", lambda *a: pytest.fail("scanned before refusing"))
    b = tmp_path / "in" / "b.jsonl"
    with b.open("a") as f:
        f.write(json.dumps({"text": "appended"}) + "\n")
    with pytest.raises(JobError, match=rf"changed since .*\({re.escape(str(b))}: size \d+ -> \d+\)"):
        plan.refuse_changed_input_early(job)
    b.unlink()
    with pytest.raises(JobError, match=rf"\({re.escape(str(b))} gone\)"):
        plan.refuse_changed_input_early(job)
    added = {**fp, "files": fp["files"] + [{**fp["files"][0], "path": "/c.jsonl"}]}
    assert plan.input_change(fp, added) == "/c.jsonl added"
    assert plan.input_change({**fp, "dataset": {"fingerprint": "a"}}, {**fp, "dataset": {"fingerprint": "b"}}) == \
        "the datasets dataset's fingerprint (its revision) differs"
    (tmp_path / "out" / "manifest.json").write_text("[]")  # (no job's: refused as such, not a traceback)
    with pytest.raises(JobError, match="is not a dynatree job's manifest"):
        plan.refuse_changed_input_early(job)


def test_input_columns_pass_through(ray_cluster, pair_dirs, tmp_path):
    keys = [f"k{i}" for i in range(5)]
    pq.write_table(pa.table({"key": keys, "text": PROMPTS[:5], "topic": [f"t{i}" for i in range(5)],
                             "score": [0.5 * i for i in range(5)], "error": ["x"] * 5}), tmp_path / "in.parquet")
    run_job(spec(pair_dirs, tmp_path, max_new_tokens=3, verify_fraction=0.0), progress=False, log=quiet)
    t = pq.read_table(tmp_path / "out" / "shards")
    assert t.column("topic").to_pylist() == [f"t{i}" for i in range(5)] and t.schema.field("score").type == pa.float64()
    assert t.column("text").to_pylist() == PROMPTS[:5] and t.column("error").to_pylist() == [None] * 5
    # every column named, in the input's order: the same output, so the same job (it resumes, and a dry run
    # says so: it said 0 shards done, the upgrade trial); in another order the output's columns differ
    named = spec(pair_dirs, tmp_path, max_new_tokens=3, verify_fraction=0.0, keep_columns="key,text,topic,score")
    plan = run_job(named, progress=False, log=quiet, dry_run=True)
    assert plan["shards_done"] == plan["shards"] and plan["rows_to_decode"] == 0
    s = run_job(spec(pair_dirs, tmp_path, max_new_tokens=3, verify_fraction=0.0, resume=True,
                     keep_columns="key,text,topic,score"), progress=False, log=quiet)  # (its error is the result's)
    assert s["rows"] == 5 and s["this_run"]["rows_this_run"] == 0
    with pytest.raises(JobError, match="changed: keep_columns"):
        run_job(spec(pair_dirs, tmp_path, max_new_tokens=3, verify_fraction=0.0, resume=True,
                     keep_columns="text,key,topic,score"), progress=False, log=quiet)
    run_job(spec(pair_dirs, tmp_path, max_new_tokens=3, verify_fraction=0.0, keep_columns="topic", overwrite=True),
            progress=False, log=quiet)
    t = pq.read_table(tmp_path / "out" / "shards")
    assert "topic" in t.column_names and "score" not in t.column_names and "text" not in t.column_names
    with pytest.raises(JobError, match="overwrite result column"):
        run_job(spec(pair_dirs, tmp_path, keep_columns="error", overwrite=True), progress=False, log=quiet)


def test_awkward_inputs(ray_cluster, pair_dirs, tmp_path):
    # mixed-type JSONL prompt column: per-row errors, as in Parquet
    vals = ["The quick brown fox", None, "", 42, "Call me"]
    (tmp_path / "mixed.jsonl").write_text("\n".join(json.dumps({"key": f"m{i}", "text": v}) for i, v in enumerate(vals)))
    run_job(spec(pair_dirs, tmp_path, input=str(tmp_path / "mixed.jsonl"), max_new_tokens=3, verify_fraction=0.0,
                 keep_columns="none"), progress=False, log=quiet)
    rows = read_rows(tmp_path / "out")
    assert [r["error"] is None for r in rows] == [True, False, False, False, True]
    assert "not a string (int)" in rows[3]["error"]
    # an empty input writes an empty dataset with the full schema
    pq.write_table(pa.table({"key": pa.array([], pa.string()), "text": pa.array([], pa.string())}),
                   tmp_path / "empty.parquet")
    s = run_job(spec(pair_dirs, tmp_path, input=str(tmp_path / "empty.parquet"), output=str(tmp_path / "o2")),
                progress=False, log=quiet)
    t = pq.read_table(tmp_path / "o2" / "shards")
    assert s["rows"] == 0 and t.num_rows == 0 and {"generated_text", "key", "text"} <= set(t.column_names)
    with pytest.raises(JobError, match="no prompt column 'txt'"):  # a typo is caught even with no rows
        run_job(spec(pair_dirs, tmp_path, input=str(tmp_path / "empty.parquet"), output=str(tmp_path / "o4"),
                     prompt_column="txt"), progress=False, log=quiet)
    (tmp_path / "empty.jsonl").write_text("")  # no rows, no columns: still just empty, with --id-column
    s = run_job(spec(pair_dirs, tmp_path, input=str(tmp_path / "empty.jsonl"), output=str(tmp_path / "o3")),
                progress=False, log=quiet)
    assert s["rows"] == 0 and "generated_text" in pq.read_table(tmp_path / "o3" / "shards").column_names


def test_model_problems_fail_in_the_driver_before_actors(pair_dirs, tmp_path, monkeypatch):
    write_input(tmp_path)
    with pytest.raises(JobError, match="--target /no/such/model: no such file"):
        run_job(spec(pair_dirs, tmp_path, target="/no/such/model"), progress=False, log=quiet)
    with pytest.raises(JobError, match="do not share a tokenizer"):
        run_job(spec(pair_dirs, tmp_path, draft=str(pair_dirs / "foreign")), progress=False, log=quiet)
    import shutil
    shutil.copytree(pair_dirs / "draft", tmp_path / "untokenized", ignore=shutil.ignore_patterns("*token*"))
    with pytest.raises(JobError, match="has no tokenizer .*and a job's prompts are text"):
        run_job(spec(pair_dirs, tmp_path, target=str(tmp_path / "untokenized")), progress=False, log=quiet)
    for dropped, said in (("*.safetensors", "no weights in this directory"), ("config.json", "no config.json")):
        shutil.copytree(pair_dirs / "draft", tmp_path / dropped[-6:], ignore=shutil.ignore_patterns(dropped))
        with pytest.raises(JobError, match=f"--draft .*: {said}"):  # (in the actors ~20 s later: the own-models trial)
            run_job(spec(pair_dirs, tmp_path, draft=str(tmp_path / dropped[-6:])), progress=False, log=quiet)
    # a draft without tokenizer files: the target's is trusted (models.load_pair does the same)
    run_job(spec(pair_dirs, tmp_path, draft=str(tmp_path / "untokenized"), output=str(tmp_path / "trusted")),
            progress=False, log=quiet)
    with pytest.raises(JobError, match="kv_window 120 \\+ kv_evict 16 exceed the models' 128-token context"):
        run_job(spec(pair_dirs, tmp_path, options={"kv_window": 120, "kv_evict": 16}), progress=False, log=quiet)
    with pytest.raises(JobError, match="--max-new-tokens 128 leaves no room for a prompt in the target's 128-token"):
        run_job(spec(pair_dirs, tmp_path, max_new_tokens=128), progress=False, log=quiet)
    shutil.copytree(pair_dirs / "target", tmp_path / "yarn")  # a rotary scaling no cache window takes
    config = json.loads((tmp_path / "yarn" / "config.json").read_text())
    config["rope_parameters"] = {**(config.get("rope_parameters") or {}), "rope_type": "yarn", "factor": 2.0}
    (tmp_path / "yarn" / "config.json").write_text(json.dumps(config))
    with pytest.raises(JobError, match="yarn: kv_window does not support scaled rotary embeddings"):
        run_job(spec(pair_dirs, tmp_path, target=str(tmp_path / "yarn"), options={"kv_window": 64, "kv_evict": 8}),
                progress=False, log=quiet)
    shutil.copytree(pair_dirs / "draft", tmp_path / "bloomish")  # an architecture that takes no tree mask
    config = json.loads((tmp_path / "bloomish" / "config.json").read_text())
    (tmp_path / "bloomish" / "config.json").write_text(json.dumps({**config, "model_type": "bloom"}))
    with pytest.raises(JobError, match=r"^--method dynatree: the draft model cannot expand token trees \(BLOOM's"):
        run_job(spec(pair_dirs, tmp_path, draft=str(tmp_path / "bloomish")), progress=False, log=quiet)
    import huggingface_hub  # the same draft as a hub id with a cached copy: its cached config.json is read
    snapshot = tmp_path / "hub" / "models--someorg--bloomish" / "snapshots" / ("0" * 40)
    shutil.copytree(tmp_path / "bloomish", snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(JobError, match=r"^--method dynatree: the draft model cannot expand token trees \(BLOOM's"):
        run_job(spec(pair_dirs, tmp_path, draft="someorg/bloomish"), progress=False, log=quiet)
    (tmp_path / "in").mkdir()
    (tmp_path / "in.parquet").rename(tmp_path / "in" / "in.parquet")
    for inp, out in ((tmp_path / "in", "out"), (tmp_path / "in" / "**" / "*.parquet", "out"),
                     (tmp_path / "in" / "*.parquet", "results.parquet")):  # (the glob matches the output itself)
        with pytest.raises(JobError, match="is where the input .* reads"):
            run_job(spec(pair_dirs, tmp_path, input=str(inp), output=str(tmp_path / "in" / out)), progress=False, log=quiet)
    assert not (tmp_path / "out").exists()  # checked before anything is written
    (tmp_path / "loop").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop")
    (tmp_path / "afile").write_text("")
    (tmp_path / "other" / "shards").mkdir(parents=True)
    (tmp_path / "other" / "manifest.json").write_text("{}")
    (tmp_path / "filed").mkdir()
    (tmp_path / "filed" / "shards").write_text("")
    (tmp_path / "dirmanifest" / "manifest.json").mkdir(parents=True)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere" / "x")
    for out, said in (("loop", "--output .*loop: Symlink loop"), ("afile", "is a file, not a directory"),
                      ("filed", r"filed/shards is a file where a directory goes"),
                      ("dirmanifest", r"dirmanifest/manifest.json is not a file"),
                      ("dangling", r"dangling is a symbolic link to nothing that exists"),
                      ("afile/x", r"cannot be used: Not a directory"), ("x" * 256 + "/y", "cannot be used: File name too "
                                                                                          "long"),
                      ("other/shards/mine", r"lies in .*other/shards, where the dynatree output .*other keeps its shards"),
                      ("other/shards", r"lies in .*other/shards"), ("bad\udcffname", "is not a UTF-8 name")):
        with pytest.raises(JobError, match=said):  # (a traceback; "not writable: File exists"; trial AK's)
            run_job(spec(pair_dirs, tmp_path, input=str(tmp_path / "in"), output=str(tmp_path / out)), progress=False,
                    log=quiet)
    with pytest.raises(JobError, match="is a symbolic link to nothing that exists"):  # (it read "... hub unreachable")
        run_job(spec(pair_dirs, tmp_path, input=str(tmp_path / "loop"), output=str(tmp_path / "out")), progress=False,
                log=quiet)


def test_cuda_on_a_cpu_cluster_fails_clearly(ray_cluster, pair_dirs, tmp_path):
    from dynatree.jobs.placement import no_gpu

    write_input(tmp_path)
    for dry_run in (True, False):  # a local job: this machine's GPUs, known before Ray starts, nothing written
        with pytest.raises(JobError, match="--device cuda: this machine has no CUDA GPU"):
            run_job(spec(pair_dirs, tmp_path, device="cuda"), progress=False, log=quiet, dry_run=dry_run)
    assert not (tmp_path / "out").exists()
    assert "--device cuda: the Ray cluster has no GPUs" in no_gpu("cuda", {"CPU": 2.0})  # a cluster's (--address)
    assert no_gpu("cuda:1", {"CPU": 2.0, "GPU": 1.0}) is None and no_gpu("cpu", {"CPU": 2.0}) is None
    with pytest.raises(JobError, match=r"memory: 9000\.0 GB}.*lower --memory-per-actor"):  # more than any node has
        run_job(spec(pair_dirs, tmp_path, memory_per_actor=9000.0), progress=False, log=quiet)

    # no shard was written, so another config on the same output is not refused (memory that fits: placed)
    s = run_job(spec(pair_dirs, tmp_path, max_new_tokens=3, verify_fraction=0.0, memory_per_actor=0.5),
                progress=False, log=quiet)
    assert s["rows"] == len(PROMPTS) and s["startup"]["actors_ready_s"] > 0
    # what ran the forward, and why not the native kernel (a float64 model)
    assert s["this_run"]["forward"].startswith("torch ops (not the native kernel: a float64 model on cpu")
    assert s["this_run"]["draft_forward"].startswith("torch ops (")  # (the draft's: a job never said it)


def test_the_driver_imports_neither_torch_nor_transformers(pair_dirs, tmp_path):
    """The driver's memory stays small on corpus jobs: the engine loads only inside actors.  A local
    job's checks of this machine too (torch counted its GPUs: 1.1 s and ~180 MB of the driver's RSS)."""
    import subprocess
    import sys
    write_input(tmp_path)
    local = spec(pair_dirs, tmp_path)
    code = ("import sys, dynatree, dynatree.jobs.driver as d, dynatree.actors.ray_actor, dynatree.cli\n"
            "from dynatree.jobs.spec import JobSpec\n"
            f"spec = JobSpec(**{local.__dict__!r})\n"
            "plan = d.run_job(spec, progress=False, log=print, dry_run=True)\n"
            "assert plan['actors'].endswith(' on this machine (they fit)'), plan\n"  # (a dry run says where actors go)
            "import dataclasses\n"
            "plan = d.run_job(dataclasses.replace(spec, address='127.0.0.1:1'), progress=False, log=print, dry_run=True)\n"
            "assert plan['actors'].endswith(' on the cluster at 127.0.0.1:1 (not asked in a dry run: whether they fit is "
            "checked when the job starts)'), plan\n"
            "try:\n    d.run_job(dataclasses.replace(spec, device='cuda'), progress=False, log=print, dry_run=True)\n"
            "    raise SystemExit('no error')\n"
            "except d.JobError as e:\n    assert 'no CUDA GPU' in str(e), e\n"
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not bad, bad")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    assert res.returncode == 0, res.stderr[-2000:]


def test_stop_rules_in_a_job(ray_cluster, pair_dirs, tmp_path):
    """--stop ends rows where ar with the same rule ends them (every row checked against it)."""
    from dynatree import generate_batch, load_pair
    write_input(tmp_path)
    pair = load_pair(str(pair_dirs / "target"), str(pair_dirs / "draft"), device="cpu", dtype="float64")
    free = generate_batch(pair, PROMPTS, "ar", max_new_tokens=12)
    stop = free[0].text[2:5]
    s = run_job(spec(pair_dirs, tmp_path, stop=(stop,), batch_size=5, num_actors=1), progress=False, log=quiet)
    rows = read_rows(tmp_path / "out")
    assert s["equivalence"]["checked"] == len(PROMPTS) and s["equivalence"]["mismatches"] == 0
    assert s["finish_reasons"]["stop"] == sum(stop in g.text for g in free) >= 1
    for r, g in zip(rows, free):
        cut = stop in g.text
        assert r["finish_reason"] == ("stop" if cut else g.finish_reason)
        assert r["generated_text"] == (g.text[:g.text.find(stop)] if cut else g.text)


def test_templated_prompts_share_their_prefix_in_a_job(ray_cluster, pair_dirs, tmp_path):
    """Prompts rendered from one template: after the first rows, each row copies the template's
    whole blocks instead of computing them (cached_prompt_tokens, the summary's total); every row
    still equals ar, and the same job without prefix caching generates the same tokens."""
    header = "Call me Ishmael. Some years ago, never mind how long precisely. Call me Ishmael. "  # ~72 tokens
    write_input(tmp_path, [header + t for t in PROMPTS])
    s = run_job(spec(pair_dirs, tmp_path, method="dynatree", dtype="float32", batch_size=4, num_actors=1),
                progress=False, log=quiet)
    rows = read_rows(tmp_path / "out")
    assert s["equivalence"]["checked"] == len(PROMPTS) and s["equivalence"]["mismatches"] == 0
    cached = [r["cached_prompt_tokens"] for r in rows]
    assert sum(c > 0 for c in cached) >= len(PROMPTS) - 2 and all(c % 32 == 0 for c in cached)
    assert s["cached_prompt_tokens"] == sum(cached) and s["prompt_tokens"] == sum(r["prompt_tokens"] for r in rows)
    off = run_job(spec(pair_dirs, tmp_path, method="dynatree", dtype="float32", batch_size=4, num_actors=1,
                       prefix_cache_gb=0.0, overwrite=True), progress=False, log=quiet)
    assert off["cached_prompt_tokens"] == 0
    assert [r["generated_token_ids"] for r in read_rows(tmp_path / "out")] == [r["generated_token_ids"] for r in rows]


def test_a_lost_head_is_named_at_once(tmp_path):
    """Actors "die" with a lost head: the driver checks the GCS and ends with a message saying so,
    at once (Ray's client would wait a minute, then abort with its own fatal error)."""
    import socket
    import subprocess
    import sys

    from dynatree.jobs import driver

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens there once closed
    dispatch = driver._Dispatch.__new__(driver._Dispatch)
    dispatch.out, dispatch.head_down_since = tmp_path, None
    ray = types.SimpleNamespace(get_runtime_context=lambda: types.SimpleNamespace(gcs_address=f"127.0.0.1:{port}"))
    dispatch._check_cluster(ray)  # a quiet spell's first failed check: a blip, maybe
    dispatch.head_down_since -= driver.HEAD_LOST_S  # still down HEAD_LOST_S later: lost
    with pytest.raises(driver.ClusterLost, match=f"lost the Ray cluster: its head \\(GCS at 127.0.0.1:{port}\\)"):
        dispatch._check_cluster(ray)
    dispatch.head_down_since = None
    with pytest.raises(driver.ClusterLost):  # an actor death with the head not answering: at once
        dispatch._check_cluster(ray, actor_died=True)
    assert not dispatch._head_answers(ray)  # (as the last shard was written: summarized without the actors)
    # shards went on finishing after the head was lost, and it was checked only in quiet spells:
    # Ray's client ended the driver at 60 s with its own one line (the two-node trial)
    checked = []
    dispatch.restarts, dispatch.head_checked, dispatch.last_done = {}, 0.0, 0.0
    dispatch._check_restarts = lambda *a: None
    dispatch._check_cluster = lambda ray_: checked.append(1)
    busy = types.SimpleNamespace(wait=lambda refs, num_returns, timeout: (refs[:1], refs[1:]))
    assert dispatch._wait(busy, {"ref": None}, None) == ["ref"] and checked == [1]
    assert dispatch._wait(busy, {"ref": None}, None) == ["ref"] and checked == [1]  # (not again within HEALTH_S)
    # said before Ray's client gives up on the head (60 s): the first failing check up to HEALTH_S after the
    # loss, lost HEAD_LOST_S later at the next check, each check waiting up to CONNECT_S (the review)
    assert 2 * driver.HEALTH_S + driver.HEAD_LOST_S + 2 * driver.CONNECT_S < 60

    code = ("import sys; from dynatree.jobs import driver\n"
            "def lost(*a, **k): raise driver.ClusterLost('lost the Ray cluster: ...')\n"
            "driver.run_job = lost\n"
            f"from dynatree.cli import main; main(['run', '--input', 'x.parquet', '--output', {str(tmp_path / 'o')!r}])")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and res.stderr.strip().endswith("Error: lost the Ray cluster: ..."), res.stderr[-2000:]
    done = code.replace("raise driver.ClusterLost('lost the Ray cluster: ...')",  # (lost once every shard was written)
                        "e = driver.ClusterLost('the head stopped answering'); e.summary = {'rows': 3}; raise e")
    driver_stub = "from dynatree.jobs import summary; summary.format_table = lambda s: f'table of {s[\"rows\"]} rows'\n"
    res = subprocess.run([sys.executable, "-c", driver_stub + done], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "table of 3 rows" in res.stdout, (res.stdout, res.stderr[-2000:])
    assert res.stderr.strip().endswith("note: the head stopped answering"), res.stderr[-2000:]


def test_a_replacement_gets_shards_only_once_ready():
    """Shards handed to a replacement still waiting for a lost node's room sat there for its whole
    deadline (2 min) while the other actors idled (the two-node trial)."""
    from collections import deque

    from dynatree.jobs import driver

    class Actor:
        def __init__(self, name):
            self.run_shard = types.SimpleNamespace(remote=lambda *a: (name, a[0]))

    d = driver._Dispatch.__new__(driver._Dispatch)
    d.actors, d.restarts, d.suspects = [Actor("ready"), Actor("replacement")], {1: ("ref", 0.0)}, set()
    d.spec, d.inflight = types.SimpleNamespace(), 3
    d.plan = types.SimpleNamespace(shard=lambda k: (f"part-{k}", 0, 4), shard_size=4)
    inflight, pending = {}, deque((k, ([], None)) for k in range(4))
    d._feed(inflight, pending)
    assert sorted(inflight) == [("ready", "part-0"), ("ready", "part-1"), ("ready", "part-2")] and len(pending) == 1
    del d.restarts[1]  # (ready now)
    d._feed(inflight, pending)
    assert ("replacement", "part-3") in inflight and not pending


def test_an_address_space_limit_sizes_the_local_object_store(monkeypatch):
    """Under `ulimit -v` 8 GiB the local Ray start died in a C++ stack: its default object store
    (~30% of RAM) is mapped by every process (trial AE; an eighth of the limit ran the job)."""
    import resource

    from dynatree.jobs import driver

    monkeypatch.setattr(resource, "getrlimit", lambda which: (8 * 2**30, resource.RLIM_INFINITY))
    assert driver._store_under_rlimit() == 2**30
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY,) * 2)
    assert driver._store_under_rlimit() is None
    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024 * 2**30, resource.RLIM_INFINITY))
    assert driver._store_under_rlimit() is None  # (never above Ray's own, which it would refuse: the review)
    # `ulimit -f`: the store is one file -- above the limit Ray's node died of SIGXFSZ, "run again" (trial AK)
    fsize = {resource.RLIMIT_AS: resource.RLIM_INFINITY, resource.RLIMIT_FSIZE: 2**30}
    monkeypatch.setattr(resource, "getrlimit", lambda which: (fsize[which], resource.RLIM_INFINITY))
    assert driver._store_under_rlimit() == 7 * 2**27
    fsize[resource.RLIMIT_FSIZE] = 20 * 1024
    with pytest.raises(JobError, match=r"the file size limit \(`ulimit -f`: 20 KiB\) is below what a local Ray "
                                       r"cluster's object store needs"):
        driver._store_under_rlimit()


def test_a_file_time_is_said_as_touch_takes_it_back():
    from dynatree.jobs.plan import _seconds

    assert _seconds(1796103820566737994) == "1796103820.566737994"  # (1796103820566737994 / 1e9: ...738 -- trial AI)
    assert _seconds(5) == "0.000000005"


def test_shards_in_flight_are_capped_by_the_job_and_a_constant():
    """Each shard in flight is a thread of the actor: --batch-size 1e8 started ~10k of them (trial AE)."""
    from dynatree.jobs import driver
    from dynatree.jobs.spec import MAX_INFLIGHT

    said = []
    d = driver._Dispatch.__new__(driver._Dispatch)
    d.log = said.append
    for batch, shards, actors, want in ((8, 10, 1, 3), (10 ** 8, 2, 1, 3), (10 ** 8, 10 ** 5, 2, MAX_INFLIGHT),
                                        (16, 1, 4, 2)):
        d.spec = build_spec(None, input="x", output="y", batch_size=batch, shard_size=4)
        assert d._inflight(shards, actors) == want
    assert len(said) == 1 and f"than the {MAX_INFLIGHT} an actor takes: batches of at most ~1020 rows" in said[0]


def test_ctrl_c_exits_130_and_says_how_to_resume(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from dynatree.cli import main
    from dynatree.jobs import driver

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(driver, "run_job", interrupted)
    args = ["run", "--input", str(tmp_path / "in.parquet"), "--output", str(tmp_path / "o")]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 130 and "no shard was finished; the same command starts the job again" in res.output
    (tmp_path / "o" / "shards").mkdir(parents=True)
    (tmp_path / "o" / "shards" / "part-000000.parquet").write_bytes(b"")
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 130 and "finished shards are kept in" in res.output and "the same command resumes" in res.output
    res = CliRunner().invoke(main, [*args, "--overwrite"])  # (the same command would start over)
    assert res.exit_code == 130 and "to resume, run it without --overwrite" in res.output, res.output


def test_a_stopped_run_records_how_far_it_got_and_report_says_it(pair_dirs, tmp_path, monkeypatch):
    """A run that is stopped writes no summary.json: its record in runs.jsonl says how it ended and
    how far the job is, the command says the counts, and report reads them (the failed-jobs trial:
    "re-run its command" was all it said, also for an output a job was writing at that moment)."""
    from click.testing import CliRunner

    from dynatree.cli import main
    from dynatree.jobs import driver, runs
    from dynatree.jobs.plan import output_lock

    write_input(tmp_path)

    def stopped(self, todo, progress):
        if self.spec.overwrite:  # (stopped while the actors load: the old output is not yet cleared)
            raise KeyboardInterrupt
        (self.out / "shards" / "part-000000.parquet").write_bytes(b"")  # (as if written; not read here)
        self.stats.update(shards_this_run=1, rows_this_run=4)
        self.failed.append(runs.failed_shard(self.plan, 2, [{"id": "k8"}], 0, "cannot read"))  # (kept: the review)
        raise KeyboardInterrupt

    monkeypatch.setattr(driver._Dispatch, "run", stopped)
    args = ["run", "--input", str(tmp_path / "in.parquet"), "--output", str(tmp_path / "out"), "--target",
            str(pair_dirs / "target"), "--draft", str(pair_dirs / "draft"), "--shard-size", "4", "--id-column", "key", "--max-new-tokens", "8"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 130 and "interrupted: 1 of 3 shards (4 of 12 rows) are finished; finished shards are " \
                                    "kept in" in res.output, res.output
    record = runs.read(tmp_path / "out")[-1]
    assert record["status"] == "interrupted" and record["this_run"]["rows_this_run"] == 4 and record["pid"] > 0
    assert record["message"] == "interrupted (Ctrl-C, SIGINT)"  # (it was "": trial AJ)
    assert [f["shard"] for f in record["failed_shards"]] == ["part-000002"]
    before = (tmp_path / "out" / "runs.jsonl").read_bytes()
    res = CliRunner().invoke(main, [*args, "--overwrite"])  # (the old job's output and record stay as they were)
    assert res.exit_code == 130 and (tmp_path / "out" / "runs.jsonl").read_bytes() == before
    res = CliRunner().invoke(main, ["report", str(tmp_path / "out")])
    assert res.exit_code == 1 and "ended interrupted" in res.output and "1 of 3 shards (4 of 12 rows) are finished; " \
        "finished shards are kept in" in res.output and "the same command resumes" in res.output, res.output
    with output_lock(str(tmp_path / "out")):  # (a job writing it now: not "re-run its command")
        res = CliRunner().invoke(main, ["report", str(tmp_path / "out")])
    assert f"a dynatree job is writing {tmp_path / 'out'} now (pid {os.getpid()} on" in res.output, res.output
    with open(tmp_path / "out" / "runs.jsonl", "ab") as f:  # (a line a full disk cut short, a foreign byte)
        f.write(b'{"status": "fai\xff')
    runs.append(tmp_path / "out", {**record, "status": "failed"})
    assert [r["status"] for r in runs.read(tmp_path / "out")] == ["interrupted", "failed"]


def test_a_job_whose_every_row_failed_exits_non_zero(ray_cluster, pair_dirs, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from dynatree.cli import main
    from dynatree.jobs import driver

    write_input(tmp_path, texts=["", "   ", None])
    s = run_job(spec(pair_dirs, tmp_path, num_actors=1), progress=False, log=quiet)
    assert s["errors"] == s["rows"] == 3
    assert sum(s["error_messages"].values()) == 3 and "prompt is empty or only whitespace" in s["error_messages"]
    from dynatree.jobs.summary import format_table  # (it blamed the id-hash sampling, at --verify-fraction 1: trial AF)
    assert "not checked: every one of the 3 rows has an error" in format_table(s)
    from dynatree.jobs import runs  # (it said "complete" where the command exits 1: trial AJ)
    assert runs.read(tmp_path / "out")[-1]["status"] == "failed" == s["runs"][-1]["status"]
    assert runs.read(tmp_path / "out")[-1]["message"].startswith("every row failed (3); the most common error, on 2 rows")
    monkeypatch.setattr(driver, "run_job", lambda *a, **k: s)
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["run", "--input", "in.parquet", "--output", "o"])
    assert res.exit_code == 1 and ("every row failed (3); the most common error, on 2 rows: 'prompt is empty or only "
                                   "whitespace' (other kinds: see the error column)\n") in res.output, res.output
    assert f"results: {tmp_path / 'o'}/shards" in res.output  # absolute (`ray job submit` runs elsewhere)
    s2 = dict(s, errors=2)
    monkeypatch.setattr(driver, "run_job", lambda *a, **k: s2)
    assert CliRunner().invoke(main, ["run", "--input", "in.parquet", "--output", "o"]).exit_code == 0

    def mismatched(*a, **k):  # --fail-on-mismatch: the job finished, so its table comes before the error
        raise driver.MismatchError("1 generation(s) differ from ar (--fail-on-mismatch); see summary.json", s2)

    monkeypatch.setattr(driver, "run_job", mismatched)
    res = CliRunner().invoke(main, ["run", "--input", "in.parquet", "--output", "o", "--fail-on-mismatch",
                                    "--verify-fraction", "1"])
    assert res.exit_code == 1 and "rows " in res.output and f"results: {tmp_path / 'o'}/shards" in res.output
    assert res.output.index("results:") < res.output.index("1 generation(s) differ from ar")


def test_a_relative_output_under_ray_job_submit_is_named_in_full(pair_dirs, tmp_path, monkeypatch):
    from dynatree.jobs import driver

    logs = []
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(JobError):  # (no input: the warning comes first)
        driver.run_job(spec(pair_dirs, tmp_path, input="missing.parquet", output="out/x"), log=logs.append)
    assert any(f"is {tmp_path / 'out' / 'x'}" in m and "absolute path" in m for m in logs), logs
    # a relative input there is named by the working directory's copy, which any change renames: said
    # up front, and a resume refused for it names the old and new paths
    from dynatree.jobs.plan import _manifest, _refuse_change, make_plan
    pkg = tmp_path / "working_dir_files" / "_ray_pkg_0123abcd"  # (what `ray job submit --working-dir .` runs in)
    pkg.mkdir(parents=True)
    monkeypatch.chdir(pkg)
    write_input(pkg)
    logs.clear()
    with pytest.raises(JobError):
        driver.run_job(spec(pair_dirs, tmp_path, input="in.parquet", output="/nonexistent/o", id_column="nope"),
                       log=logs.append)
    assert [m for m in logs if m.startswith(f"warning: --input {pkg / 'in.parquet'} lies in the copy of the working "
                                            "directory")], logs
    write_input(tmp_path)
    shutil.copy(tmp_path / "in.parquet", tmp_path / "moved.parquet")
    job = spec(pair_dirs, tmp_path)
    moved = dataclasses.replace(job, input=str(tmp_path / "moved.parquet"))
    with pytest.raises(JobError, match=f"changed: input: {tmp_path / 'in.parquet'} -> {tmp_path / 'moved.parquet'}\\)"):
        _refuse_change(tmp_path, _manifest(job, make_plan(job, quiet)), _manifest(moved, make_plan(moved, quiet)))


def test_an_input_id_column_is_the_default_id(pair_dirs, tmp_path):
    """No --id-column: the input's own `id` column gives the ids (it was dropped for row indexes,
    the output's `id` being a result column); one with duplicates or nulls, or an output begun
    with row indexes, keeps row indexes."""
    from dynatree.jobs.plan import default_ids, make_plan, prepare_output
    logs = []
    pq.write_table(pa.table({"id": [f"a{i}" for i in range(4)], "text": PROMPTS[:4]}), tmp_path / "in.parquet")
    job = spec(pair_dirs, tmp_path, id_column=None)
    assert default_ids(job, logs.append)[0].id_column == "id" and "the input's id column" in logs[-1]
    with_id = dataclasses.replace(default_ids(job, logs.append)[0], keep_columns=("id", "text"))
    assert make_plan(with_id, quiet).kept_names == ["text"]  # (the row-id column is the output's id already)
    assert default_ids(spec(pair_dirs, tmp_path, id_column="text"), logs.append)[0].id_column == "text"
    prepare_output(job, make_plan(job, quiet))  # an output begun (by an older version) with row indexes
    assert default_ids(job, logs.append)[0].id_column is None
    assert default_ids(dataclasses.replace(job, overwrite=True), logs.append)[0].id_column == "id"
    nested = pa.table({"id": [{"n": i} for i in range(4)], "meta": [[i] for i in range(4)], "text": PROMPTS[:4]})
    pq.write_table(nested, tmp_path / "in.parquet")  # struct or list columns hold no ids
    assert default_ids(spec(pair_dirs, tmp_path, id_column=None, output=str(tmp_path / "o4")),
                       logs.append)[0].id_column is None
    assert "row indexes, not the input's id column (it holds struct<n: int64> values)" in logs[-1]
    good = pa.table({"id": ["b1", "b2"], "text": PROMPTS[:2]})
    pq.write_table(good, tmp_path / "in.parquet")
    damaged = bytearray((tmp_path / "in.parquet").read_bytes())
    damaged[4:40] = b"\0" * 36  # (the first page's header: the footer still reads)
    (tmp_path / "in.parquet").write_bytes(bytes(damaged))
    with pytest.raises(JobError, match="cannot read rows 0-1"):  # not row indexes, then a job that stops on it
        default_ids(spec(pair_dirs, tmp_path, id_column=None, output=str(tmp_path / "o6")), logs.append)
    pq.write_table(nested, tmp_path / "in.parquet")
    for col in ("id", "meta"):
        with pytest.raises(JobError, match=f"--id-column '{col}' holds (struct|list).* values; ids are strings or"):
            make_plan(spec(pair_dirs, tmp_path, id_column=col), quiet)
    pq.write_table(pa.table({"id": ["a", "a", "b", "c"], "text": PROMPTS[:4]}), tmp_path / "in.parquet")
    other = spec(pair_dirs, tmp_path, id_column=None, output=str(tmp_path / "o2"))
    other, source = default_ids(other, logs.append)
    assert other.id_column is None and "duplicate ids" in logs[-1]
    plan = make_plan(other, logs.append, source)  # the user's ids are still there to join on
    assert plan.kept_names == ["input_id", "text"] and "copied as input_id (the output's id is the row index)" in logs[-1]
    make_plan(spec(pair_dirs, tmp_path, id_column="text", output=str(tmp_path / "o5")), logs.append)
    assert "copied as input_id (the output's id is column 'text')" in logs[-1]  # (it said "the row id")
    from dynatree.jobs.driver import _read_shard
    assert _read_shard(other, plan, 0)[1].column("input_id").to_pylist() == ["a", "a", "b", "c"]
    named = dataclasses.replace(other, keep_columns=("id",))  # asked for by name: the same input_id
    named_plan = make_plan(named, quiet, source)
    assert named_plan.kept_names == ["input_id"]
    assert _read_shard(named, named_plan, 0)[1].column("input_id").to_pylist() == ["a", "a", "b", "c"]
    out = tmp_path / "o2"
    (out / "shards").mkdir(parents=True)
    pq.write_table(pa.table({"id": ["0"], "text": ["t"]}), out / "shards" / "part-000000.parquet")  # begun without it:
    assert make_plan(other, quiet, source).kept_names == ["text"]  # resumes so (its manifest may predate a column list)
    # an input_id of the input's own stays as it is; the id goes to the next free name
    pq.write_table(pa.table({"id": ["a", "a", "b", "c"], "input_id": list("wxyz"), "text": PROMPTS[:4]}),
                   tmp_path / "in.parquet")
    third = spec(pair_dirs, tmp_path, id_column=None, output=str(tmp_path / "o3"))
    third, source = default_ids(third, logs.append)
    plan = make_plan(third, logs.append, source)
    assert plan.kept_names == ["input_id_2", "input_id", "text"] and "copied as input_id_2" in logs[-1]
    kept = _read_shard(third, plan, 0)[1]
    assert kept.column("input_id_2").to_pylist() == ["a", "a", "b", "c"] and kept.column("input_id").to_pylist() == list("wxyz")
    named = dataclasses.replace(third, keep_columns=("id", "input_id"))
    assert make_plan(named, quiet, source).kept_names == ["input_id_2", "input_id"]
    named = dataclasses.replace(third, keep_columns=("id",))  # the same name, kept or not
    assert make_plan(named, quiet, source).kept_names == ["input_id_2"]


def test_fewer_shards_than_actors_start_fewer_actors_and_say_so(ray_cluster, pair_dirs, tmp_path):
    write_input(tmp_path, texts=PROMPTS[:3])
    logs = []
    s = run_job(spec(pair_dirs, tmp_path, verify_fraction=0.0), progress=False, log=logs.append)
    assert s["rows"] == 3 and len(s["this_run"]["actors"]) == 1
    assert any("1 shard(s) left to decode: starting 1 of 2 actors" in m for m in logs), logs


def test_actors_hear_how_many_rows_the_job_still_has_for_them():
    """The batch tuner explores only while enough rows are left to profit (scheduler.py): each
    shard sent tells its actor the job's backlog, that actor's share of the shards not yet sent."""
    from collections import deque

    from dynatree.jobs.driver import _Dispatch
    from dynatree.jobs.plan import Plan

    calls = []

    class Actor:
        class run_shard:
            @staticmethod
            def remote(shard, rows, backlog):
                calls.append((shard, backlog))
                return object()

    d = _Dispatch(dataclasses.replace(build_spec(None, input="x", output="y"), max_inflight_per_actor=2),
                  Plan(types.SimpleNamespace(num_rows=40), shard_size=4, keep=(), schema=pa.schema([])), None, {}, {}, quiet)
    d.actors, d.inflight = [Actor(), Actor()], 2
    pending = deque((k, ([{"id": str(k), "text": "t"}], None)) for k in range(10))
    d._feed({}, pending)
    assert [b for _, b in calls] == [9 * 4 // 2, 8 * 4 // 2, 7 * 4 // 2, 6 * 4 // 2]


def test_a_line_said_mid_job_goes_above_the_progress_bar(capsys):
    """"0/150 [..?row/s]shard part-000004 failed ...": a line said while the bar is drawn went onto it."""
    import sys

    from tqdm import tqdm

    from dynatree.jobs.driver import _above

    bar = tqdm(total=10, file=sys.stderr, disable=False, ncols=60)
    bar.update(3)
    _above(bar, lambda m: print(m, file=sys.stderr), "shard part-000004 failed")
    bar.close()
    err = capsys.readouterr().err
    line = next(ln for ln in err.split("\n") if "shard part-000004 failed" in ln)
    assert line.split("\r")[-1].strip() == "shard part-000004 failed", repr(err)


def test_the_drivers_dynatree_settings_reach_the_actors(monkeypatch):
    """On a cluster's nodes actors read the node's environment: DYNATREE_ISA=generic ran avx512 and
    DYNATREE_CACHE was another (the concurrent-jobs trial); the driver's go with them."""
    from dynatree.jobs import driver

    monkeypatch.setenv("DYNATREE_ISA", "generic")
    monkeypatch.setenv("CC", "ccache gcc")
    monkeypatch.setenv("DYNATREE_CACHE", "/data/cache")
    got = driver._forwarded_env()
    assert {k: got[k] for k in ("DYNATREE_ISA", "CC", "DYNATREE_CACHE")} == \
        {"DYNATREE_ISA": "generic", "CC": "ccache gcc", "DYNATREE_CACHE": "/data/cache"}
    assert "HOME" not in got and "PATH" not in got
    monkeypatch.setenv("DYNATREE_CACHE", "rel/cache")  # (read from the actor's working directory: made absolute)
    assert driver._forwarded_env()["DYNATREE_CACHE"] == os.path.abspath("rel/cache")


def test_a_ray_start_that_cannot_write_says_so(monkeypatch):
    """A read-only home: Ray's token auth writes ~/.ray, and the job said "[Errno 30] ...; the same
    command starts the job again", blaming nothing (the install trial)."""
    import ray

    from dynatree.jobs import driver

    def read_only(**kw):
        raise OSError(30, "Read-only file system", "/home/u/.ray")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(driver, "start_local_ray", read_only)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(JobError, match=r"^starting the local Ray cluster failed: \[Errno 30\] Read-only file system: "
                                       r"'/home/u/.ray' \(Ray writes"):
        driver._init_ray(build_spec(None, input="x", output="y"), log=quiet)


def test_a_token_ray_cannot_read_is_a_message_not_a_traceback(tmp_path):
    import subprocess
    import sys

    (tmp_path / "in.jsonl").write_text('{"id": "a", "text": "hello there"}\n')
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "missing")}
    env.pop("RAY_ADDRESS", None)
    res = subprocess.run([sys.executable, "-m", "dynatree.cli", "run", "--input", str(tmp_path / "in.jsonl"),
                          "--output", str(tmp_path / "out"), "--max-new-tokens", "2"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "Ray token authentication failed" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr


def test_a_second_job_on_an_output_being_written_is_refused(pair_dirs, tmp_path):
    """Two jobs on one --output both "succeeded", leaving one's shards under the other's manifest."""
    from dynatree.jobs.plan import output_lock

    write_input(tmp_path)
    with output_lock(str(tmp_path / "out")):  # the first job's driver, mid-run
        with pytest.raises(JobError, match=f"another dynatree job is writing {tmp_path / 'out'} \\(pid {os.getpid()}"):
            run_job(spec(pair_dirs, tmp_path), progress=False, log=quiet)
        with pytest.raises(JobError, match="another dynatree job is writing"):  # a dry run says what the run would
            run_job(spec(pair_dirs, tmp_path), progress=False, log=quiet, dry_run=True)
        assert (tmp_path / "out" / ".dynatree.lock").read_text().startswith(f"pid {os.getpid()}")  # (the refused one's not)
        # the refused job saw no output directory, then the holder made it: the refused one's clean-up had
        # removed the holder's manifest, lock and shards (the concurrent-jobs trial)
        (tmp_path / "out" / "manifest.json").write_text("{}")
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(os.path, "lexists", lambda p: False if str(p) == str(tmp_path / "out") else os.path.exists(p))
            with pytest.raises(JobError, match="another dynatree job is writing"):
                run_job(spec(pair_dirs, tmp_path), progress=False, log=quiet)
        assert (tmp_path / "out" / "manifest.json").exists() and (tmp_path / "out" / ".dynatree.lock").exists()
        (tmp_path / "out" / "manifest.json").unlink()
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert (tmp_path / "out" / ".dynatree.lock").read_text() == ""  # released: no pid reads as a job still running


def test_an_os_error_mid_job_is_a_message_that_says_how_to_go_on(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from dynatree.cli import main
    from dynatree.jobs import driver

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(driver, "run_job", full)
    (tmp_path / "o" / "shards").mkdir(parents=True)
    (tmp_path / "o" / "shards" / "part-000000.parquet").write_bytes(b"")
    res = CliRunner().invoke(main, ["run", "--input", "x.parquet", "--output", str(tmp_path / "o")])
    assert res.exit_code == 1 and "No space left on device; once that is fixed -- finished shards are kept" in res.output
    assert isinstance(res.exception, SystemExit)  # no traceback


def test_a_job_logging_to_a_file_reports_progress_now_and_then():
    from dynatree.jobs.driver import _LogProgress

    lines = []
    p = _LogProgress(100, lines.append, every_s=0.0)
    p.update(40, 400)
    p.update(60, 1000)  # the end: the summary says the rest
    assert len(lines) == 1 and lines[0].startswith("progress: 40/100 rows (40.0%)") and " s left" in lines[0]
    p = _LogProgress(100, lines.append, every_s=3600.0)
    p.update(10, 100)
    assert len(lines) == 1
    p = _LogProgress(100, lines.append, every_s=0.0, before=60)  # a resume: the job's rows, not this run's alone
    p.update(40, 400)
    assert lines[-1].startswith("progress: 100/160 rows (62.5%; 60 decoded by earlier runs)"), lines[-1]


def test_a_dry_run_prints_the_plan_and_writes_nothing(pair_dirs, tmp_path):
    from click.testing import CliRunner

    from dynatree.cli import main

    write_input(tmp_path)
    res = CliRunner().invoke(main, ["run", "--input", str(tmp_path / "in.parquet"), "--output", str(tmp_path / "out"),
                                    "--target", str(pair_dirs / "target"), "--draft", str(pair_dirs / "draft"),
                                    "--max-new-tokens", "8", "--shard-size", "4", "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "rows_to_decode         12" in res.output and "shards                 3" in res.output
    assert not (tmp_path / "out").exists() and sorted(os.listdir(tmp_path)) == ["in.parquet"]  # (no probe left)
    # an output the run could not make: refused by the dry run too (os.access let root through)
    res = CliRunner().invoke(main, ["run", "--input", str(tmp_path / "in.parquet"), "--output", "/proc/dynatree-out",
                                    "--target", str(pair_dirs / "target"), "--draft", str(pair_dirs / "draft"),
                                    "--max-new-tokens", "8", "--dry-run"])
    assert res.exit_code == 1 and "output directory /proc/dynatree-out is not writable: /proc:" in res.output, res.output


def test_an_output_held_to_a_shorter_drafts_context_is_not_resumed_past_it(tmp_path):
    """Before 2026-12-01 a pair whose draft has fewer positions than its target held rows to the draft's
    context (prompts cut to it less T); now to the target's: a resume across the upgrade mixed 64- and
    200-token prompts silently (the upgrade trial).  Pinned per output; refused only where it cuts."""
    from dynatree.jobs.plan import pin_context, read_manifest

    out = tmp_path / "o"
    (out / "shards").mkdir(parents=True)
    (out / "manifest.json").write_text(json.dumps({"identity_hash": "h"}))  # an older version's
    job = build_spec(None, input="x", output=str(out), max_prompt_tokens=200, max_new_tokens=32)
    pin_context(out, job, 1024, 96)  # no shard yet: this run's pinned
    assert read_manifest(out)["context"] == 1024
    (out / "manifest.json").write_text(json.dumps({"identity_hash": "h"}))
    (out / "shards" / "part-000000.parquet").write_bytes(b"")  # shards of the older version (held to 96)
    with pytest.raises(JobError, match=r"rows held to a 96-token context .* the target's 1024, which keeps more of "
                                       r"each prompt beside --max-new-tokens 32"):
        pin_context(out, job, 1024, 96)
    pin_context(out, build_spec(None, input="x", output=str(out), max_prompt_tokens=48, max_new_tokens=32), 1024, 96)
    assert read_manifest(out)["context"] == 1024  # (48 + 32 fit in 96: the prompts were cut alike)
    pin_context(out, job, 1024, 96)  # (pinned now: the same context)
    with pytest.raises(JobError, match="rows held to a 1024-token context"):  # and a later run held to another
        pin_context(out, job, 128)
    pin_context(out, job, 1024, 0)  # a pair with a draft as long: nothing changed for it


def test_an_output_prompted_without_the_bos_is_not_resumed_with_it(tmp_path):
    """Shards an older version wrote prompted a Llama-style tokenizer's texts without its BOS; this
    version starts them with it: resuming would mix the two, so it is refused (pinned per output)."""
    from dynatree.jobs.plan import pin_prompt_start, read_manifest
    out = tmp_path / "o"
    (out / "shards").mkdir(parents=True)
    (out / "manifest.json").write_text(json.dumps({"identity_hash": "h"}))  # an older version's, before any shard
    pin_prompt_start(out, [1])  # no shard yet: pinned
    assert read_manifest(out)["leading_ids"] == [1]
    pin_prompt_start(out, [1])
    (out / "shards" / "part-000000.parquet").write_bytes(b"")
    with pytest.raises(JobError, match=r"prompted with the ids \[1\] before each text .*start them with no special "
                                       "token.*--overwrite"):
        pin_prompt_start(out, [])
    (out / "manifest.json").write_text(json.dumps({"identity_hash": "h"}))  # shards from before the pin: no BOS
    with pytest.raises(JobError, match="prompted with no special token before each text .*with the ids \\[1\\]"):
        pin_prompt_start(out, [1])
    pin_prompt_start(out, [])  # (a tokenizer that puts none, as GPT-NeoX's: the same job)
    assert read_manifest(out)["leading_ids"] == []


def test_an_output_whose_texts_an_older_rule_wrote_is_not_resumed_where_they_differ(tmp_path):
    """Texts decoded after the prompt and stop strings cut from EOS rows (2026-12-01): shards an older
    version wrote read otherwise under a SentencePiece tokenizer or a stop in the EOS text."""
    from dynatree import Stop, load_pair
    from dynatree.jobs.plan import TEXT_RULE, pin_text_rule, read_manifest
    from dynatree.stops import texts_changed
    out = tmp_path / "o"
    (out / "shards").mkdir(parents=True)
    (out / "manifest.json").write_text(json.dumps({"identity_hash": "h"}))
    (out / "shards" / "part-000000.parquet").write_bytes(b"")
    pin_text_rule(out, False)  # (texts this job writes alike under both rules: pinned, resumed)
    assert read_manifest(out)["text_rule"] == TEXT_RULE
    pin_text_rule(out, True)  # (begun under this rule)
    (out / "manifest.json").write_text(json.dumps({"identity_hash": "h"}))
    with pytest.raises(JobError, match="written by dynatree before 2026-12-01.*--overwrite"):
        pin_text_rule(out, True)
    demo = load_pair(device="cpu")  # a byte-level tokenizer: only a stop in the EOS text changed
    assert not texts_changed(demo, None) and not texts_changed(demo, Stop(("\n\n",)))
    assert texts_changed(demo, Stop(("endoftext",))) and texts_changed(demo, Stop(("\ufffd",)))
    assert texts_changed(demo, Stop((".<|endof",)))  # (begun before the EOS text, completed by it: cut since)


def test_shards_of_other_column_types_are_not_resumed_into(pair_dirs, tmp_path):
    """A version that reads the input differently (a JSONL column typed from every row, views
    stored plain) would add shards that do not read as one dataset with the old ones."""
    from dynatree.jobs.plan import check_output, make_plan, prepare_output

    write_input(tmp_path)
    job = spec(pair_dirs, tmp_path)
    plan = make_plan(job, quiet)
    out = prepare_output(job, plan)
    pq.write_table(plan.schema.empty_table(), out / "shards" / "part-000000.parquet")
    check_output(job, plan)  # this version's own shards: resumed
    other = plan.schema.set(plan.schema.get_field_index("text"), pa.field("text", pa.large_string()))
    pq.write_table(other.empty_table(), out / "shards" / "part-000000.parquet")
    with pytest.raises(JobError, match=r"written with other output columns \(text: string in this run"):
        check_output(job, plan)
    (out / "manifest.json").write_text("{not json")
    with pytest.raises(JobError, match="manifest.json cannot be read"):
        check_output(job, plan)


def test_top_level_files_dynatree_did_not_write_are_never_replaced(pair_dirs, tmp_path):
    """An --output holding no shards yet but a manifest.json that cannot be read or is not a
    dynatree job's, or a summary.json with no manifest: a run would replace them, so it refuses,
    and so does a dry run (which passed an unreadable manifest, quietly switching to row-index
    ids); --overwrite replaces them."""
    from dynatree.jobs.plan import check_output, make_plan

    write_input(tmp_path)
    job = spec(pair_dirs, tmp_path)
    (tmp_path / "out").mkdir()
    for name, text, said in (("manifest.json", "not json", "manifest.json cannot be read"),
                             ("manifest.json", '{"files": ["a"]}', "manifest.json is not a dynatree job's manifest"),
                             ("summary.json", '{"mine": 1}', "holds a summary.json but no manifest.json")):
        (tmp_path / "out" / name).write_text(text)
        with pytest.raises(JobError, match=said):
            run_job(job, progress=False, log=quiet, dry_run=True)
        check_output(dataclasses.replace(job, overwrite=True), make_plan(job, quiet))
        (tmp_path / "out" / name).unlink()
    assert run_job(job, progress=False, log=quiet, dry_run=True)["shards_done"] == 0


def test_the_summary_counts_every_row_of_every_shard(tmp_path):
    """summary.json's counts and moments against the same computed row by row in Python."""
    import statistics

    from dynatree.jobs.summary import _COLUMNS, summarize
    from dynatree.metrics import output_schema, result_row

    assert set(_COLUMNS) <= set(output_schema(sampled=True).names)  # the summary reads the output's columns

    rows = []
    for i in range(23):
        r = result_row(f"r{i}", "dynatree", error="too long" if i % 7 == 3 else None)
        if i in (12, 13):  # one kind of error: the messages differ in their numbers only
            r.update(error=f"prompt of {600 + i} tokens is longer than the 512", finish_reason="error")
        if r["error"] is None:
            r.update(finish_reason="length" if i % 2 else "eos", num_generated_tokens=10 + i, lookup_tokens=i % 3,
                     prompt_tokens=50, cached_prompt_tokens=32 if i % 4 == 0 else 0, tokens_per_s=1e6 + i * 0.25,
                     tokens_per_iteration=None if i == 6 else 0.0 if i == 14 else 1 + i / 10,
                     acceptance_rate=None if i in (5, 6) else i / 30, ttft_s=0.01 * i,
                     tpot_s=0.002, matches_ar=None if i % 5 == 0 else i != 8, ar_tokens_per_s=0.0 if i == 9 else 5e5,
                     first_divergence=3 if i == 8 else None, iterations=0 if i in (6, 14) else 4 + i)  # (6: its
            # token came from the prefill -- no iteration: its per-iteration ratios are null, metrics.Metrics;
            # 14: the same row as a shard written before 2026-11-28 holds it, 0.0)
        rows.append(r)
    (tmp_path / "shards").mkdir()
    for k, part in enumerate((rows[:10], rows[10:], [])):
        pq.write_table(pa.Table.from_pylist(part, schema=output_schema()), tmp_path / "shards" / f"part-{k:06d}.parquet")
    s = summarize(tmp_path, types.SimpleNamespace(to_dict=lambda: {"output": "rel/out"}, samples=1), {})
    assert s["config"]["output"] == os.path.abspath("rel/out")  # (a reader elsewhere finds the shards)
    from dynatree.jobs.summary import _config
    from dynatree.names import default_pair_dir
    demo = _config(build_spec(None, input="x", output="y"))  # (the bundled pair read null: trial AJ)
    assert (demo["target"], demo["draft"]) == (str(default_pair_dir() / "target"), str(default_pair_dir() / "draft"))
    assert Path(demo["target"]).is_dir() and _config(build_spec(None, input="x", output="y", method="ar"))["draft"] is None
    ok = [r for r in rows if r["error"] is None]
    checked = [r for r in ok if r["matches_ar"] is not None]
    assert (s["rows"], s["errors"], s["error_messages"]) == (23, 5, {"too long": 3, "prompt of 612 tokens is longer than the 512": 2})
    assert s["generated_tokens"] == sum(r["num_generated_tokens"] for r in ok)
    assert (s["lookup_tokens"], s["cached_prompt_tokens"]) == (sum(r["lookup_tokens"] for r in ok),
                                                               sum(r["cached_prompt_tokens"] for r in ok))
    assert s["finish_reasons"] == {"eos": 10, "error": 5, "length": 8}
    for name, key in (("tokens_per_s_per_prompt", "tokens_per_s"), ("acceptance_rate", "acceptance_rate"),
                      ("tokens_per_iteration", "tokens_per_iteration")):
        vals = [r[key] for r in ok if r[key] is not None and (key == "tokens_per_s" or r["iterations"])]
        assert s[name]["n"] == len(vals) and s[name]["mean"] == pytest.approx(statistics.fmean(vals), rel=1e-12)
        assert s[name]["std"] == pytest.approx(statistics.stdev(vals), rel=1e-9)  # (1e6 + small: no cancellation)
    speedups = [r["tokens_per_s"] / r["ar_tokens_per_s"] for r in checked if r["ar_tokens_per_s"]]
    assert s["speedup_vs_ar"]["n"] == len(speedups)
    assert s["speedup_vs_ar"]["mean"] == pytest.approx(statistics.fmean(speedups))
    eq = s["equivalence"]
    assert (eq["checked"], eq["mismatches"]) == (len(checked), 1)
    assert eq["mismatched_rows"] == [{"id": "r8", "first_divergence": 3, "divergence_margin": None}]


def test_the_summary_counts_ten_kinds_of_error_and_the_rest_together(tmp_path):
    from dynatree.jobs.summary import OTHER_ERRORS, summarize
    from dynatree.metrics import output_schema, result_row

    rows = [result_row(f"r{i}", "ar", error=f"kind {chr(97 + i // 2)}") for i in range(24)]  # 12 kinds, 2 rows each
    rows += [result_row(f"s{i}", "ar", error=f"row {i} of 2048 tokens is long") for i in range(5)]  # a 13th, seen last
    (tmp_path / "shards").mkdir()
    pq.write_table(pa.Table.from_pylist(rows[:24], schema=output_schema()), tmp_path / "shards" / "part-000000.parquet")
    pq.write_table(pa.Table.from_pylist(rows[24:], schema=output_schema()), tmp_path / "shards" / "part-000001.parquet")
    kinds = summarize(tmp_path, types.SimpleNamespace(to_dict=dict, samples=1), {})["error_messages"]
    assert next(iter(kinds.items())) == ("row 0 of 2048 tokens is long", 5)  # the commonest, under a real message
    assert len(kinds) == 11 and kinds[OTHER_ERRORS] == 6 and sum(kinds.values()) == 29


def test_signals_while_ray_starts_are_held_then_raised(monkeypatch):
    """Ctrl-C or SIGTERM while a job starts its local Ray cluster: held to the end of the start (an
    interrupted start left Ray's agents running, and ray.init's own handler exited with 15, no
    resume message), then raised as the command's Terminated / KeyboardInterrupt -- also when the
    start fails; a second one raises at once; ray.init cannot swap its SIGTERM handler in
    meanwhile; afterwards SIGTERM ends the command (no moment with the default, fatal handler)."""
    import signal
    import types

    import ray
    from dynatree import signals

    assert callable(ray._private.utils.set_sigterm_handler)  # what ray.init calls (held_while_starting)
    monkeypatch.setattr(signals, "_asked", True)

    class Unheld(Exception):
        pass

    def unheld(_signum, _frame):  # a regressed hold fails the test instead of killing pytest
        raise Unheld()

    old = signal.signal(signal.SIGTERM, unheld)
    sigint = signal.getsignal(signal.SIGINT)  # (SIG_IGN, not Python's handler, in a job started with `&`)
    try:
        swapped = []
        fake_utils = types.SimpleNamespace(set_sigterm_handler=swapped.append)  # ray._private.utils
        for sig, kind in ((signal.SIGTERM, signals.Terminated), (signal.SIGINT, KeyboardInterrupt)):
            finished = []
            with pytest.raises(kind):
                with signals.held_while_starting(fake_utils):
                    fake_utils.set_sigterm_handler("ray's handler")
                    os.kill(os.getpid(), sig)
                    time.sleep(0.05)
                    finished.append(True)  # the start runs to its end
            assert finished == [True] and swapped == []
        assert fake_utils.set_sigterm_handler == swapped.append  # (put back)
        assert signal.getsignal(signal.SIGINT) is sigint  # (put back)
        with pytest.raises(signals.Terminated):  # SIGTERM now ends the command
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
        with pytest.raises(signals.Terminated) as got:  # a start that fails still ends as asked
            with signals.held_while_starting(fake_utils):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
                raise ConnectionError("the start failed")
        assert isinstance(got.value.__cause__, ConnectionError)
        with pytest.raises(signals.Terminated):
            with signals.held_while_starting(fake_utils):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
                pytest.fail("a second signal must stop a start at once")
    finally:
        signal.signal(signal.SIGTERM, old)


def test_the_speedup_line_says_which_checked_rows_it_covers():
    """Per-row speedups exist only for rows decoded one at a time: a job resumed at another batch size
    says over how many of its checked rows the speedup is (it had read "re-decoded with ar: 8" beside
    "matches ar 21/21")."""
    from dynatree.jobs.summary import _speedup_line

    def line(n, checked):
        return _speedup_line({"speedup_vs_ar": {"n": n, "mean": 1.5 if n else None, "std": 0.1 if n else None},
                              "equivalence": {"checked": checked}})

    assert line(8, 21) == "1.50 ± 0.10  (over the 8 of 21 checked rows decoded one at a time)"
    assert line(21, 21) == "1.50 ± 0.10  (rows re-decoded with ar: 21)"
    assert line(0, 21).startswith("-  (checked rows shared forwards at batch size > 1")
    assert line(0, 0) == "-  (rows re-decoded with ar: 0)"


def test_sigterm_inside_ray_get_still_reads_as_sigterm(ray_cluster):
    """SIGTERM landing inside ray.get, where a job's driver mostly waits: Ray turns the handler's
    Terminated into a plain KeyboardInterrupt, which read as Ctrl-C (exit 130, "interrupted")
    although the job was terminated; it reads as SIGTERM (143)."""
    import signal
    import threading

    import ray
    from dynatree import signals

    @ray.remote(num_cpus=0)
    def sleep():
        time.sleep(30)

    old = signal.getsignal(signal.SIGTERM)
    try:
        signals.end_on_sigterm()
        timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
        with pytest.raises(KeyboardInterrupt) as got:
            ray.get(sleep.remote(), timeout=20)
        timer.join()
        assert signals.interrupted(got.value) == ("terminated (SIGTERM)", 143)
        assert signals.interrupted(KeyboardInterrupt()) == ("interrupted", 130)  # reported once: Ctrl-C after it is Ctrl-C
        with pytest.raises(signals.Terminated):  # one caught where no command reports it (a library, a notebook)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
        signals.end_on_sigterm()  # the next command's Ctrl-C is Ctrl-C
        assert signals.interrupted(KeyboardInterrupt()) == ("interrupted", 130)
    finally:
        signal.signal(signal.SIGTERM, old)


def test_a_ray_client_session_that_fails_to_start_is_not_blamed_on_tokens():
    """Ray's client server failing to start a session (under load, a `ray://` address) read as a
    token-authentication problem; the hint now names what failed."""
    from dynatree.jobs.driver import _connect_hint

    busy = ConnectionError("Starting Ray client server failed. See ray_client_server_23000.err for detailed logs.")
    assert "client server could not start a session" in _connect_hint(busy) and "token" not in _connect_hint(busy)
    assert "RAY_AUTH_MODE" in _connect_hint(ConnectionError("Failed to connect to GCS"))


def test_a_finished_job_exits_quietly_through_ray_shutdown():
    """signals.quiet_exit: a Ctrl-C while Ray's exit-time shutdown runs (an atexit handler
    registered before it, as ray.init's is) is ignored -- it printed Ray's traceback under a
    finished job's table -- and a second one ends the process at once."""
    import subprocess
    import sys

    script = """if True:
        import atexit, os, signal, sys, time
        def ray_shutdown():  # what ray.init registers: a few seconds at exit
            for _ in range(int(sys.argv[1])):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)
            print("shutdown finished")
        atexit.register(ray_shutdown)
        from dynatree.signals import quiet_exit
        quiet_exit()
        quiet_exit()  # (once per process)
        print("table")
    """
    once = subprocess.run([sys.executable, "-c", script, "1"], capture_output=True, text=True, timeout=60)
    assert once.returncode == 0 and once.stdout.split() == ["table", "shutdown", "finished"], once
    assert "Traceback" not in once.stderr, once.stderr
    twice = subprocess.run([sys.executable, "-c", script, "2"], capture_output=True, text=True, timeout=60)
    assert twice.returncode == 130 and "shutdown finished" not in twice.stdout, twice
    late = """if True:  # (after the exit handlers: Python's finalization put back SIGINT's default, 130: trial AM)
        import os, signal, time
        from dynatree import signals
        signals.ask()  # (a command line's start, before ray.init)
        class Core:  # what Ray's core worker does at module teardown
            def __del__(self):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)
                os.write(1, b"torn down")
        core = Core()
        signals.quiet_exit()
    """
    torn = subprocess.run([sys.executable, "-c", late], capture_output=True, text=True, timeout=60)
    assert torn.returncode == 0 and torn.stdout == "torn down", torn


def test_a_command_line_ends_on_sigterm_from_its_start(monkeypatch):
    """`dynatree run` asks for SIGTERM to end it as Ctrl-C does: from the start, not only once Ray
    runs (SIGTERM while the job was planned killed it with no message and no exit code of its own)."""
    import signal

    from dynatree import signals

    class Unheld(Exception):
        pass

    def unheld(_signum, _frame):  # what a regressed ask leaves: fails the test instead of killing pytest
        raise Unheld()

    monkeypatch.setattr(signals, "_asked", False)
    old = signal.signal(signal.SIGTERM, unheld)
    try:
        signals.ask()
        with pytest.raises(signals.Terminated) as got:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
        assert signals.interrupted(got.value) == ("terminated (SIGTERM)", 143)
    finally:
        signal.signal(signal.SIGTERM, old)


def test_the_summary_names_the_best_batch_size_the_tuner_measured():
    """Under --batch-size auto the size being tried when a job ends can be the slowest measured,
    or one never measured: the table adds the best measured size and its rate."""
    from dynatree.jobs.summary import _batch_of

    tuned = {"batch_size": 4, "rates": {"16": 2429.7, "8": 2557.8, "4": 2170.2}}
    assert _batch_of(tuned) == "4 (auto; best measured 8: 2558 tokens/s)"
    assert _batch_of({"batch_size": 16, "rates": {}}) == "16"  # a fixed size


def test_a_shards_footer_stays_small_whatever_its_error_messages():
    """The summary's part in a shard's footer counts errors by kind (numbers written N), each kind
    with its first message: one message per row (a number in each) made a 100,000-row shard's
    footer 20 MB."""
    from dynatree.jobs.summary import shard_tally
    from dynatree.metrics import output_schema

    rows = [{"id": str(i), "error": f"prompt of {1000 + i} tokens leaves no room", "finish_reason": "error",
             "num_generated_tokens": 0} for i in range(5000)]
    part = shard_tally(pa.Table.from_pylist(rows, schema=output_schema(False)), False)
    assert part["errors"] == 5000 and part["error_kinds"] == [["prompt of N tokens leaves no room", 5000,
                                                                "prompt of 1000 tokens leaves no room"]]
    assert len(json.dumps(part)) < 2000


def _fake_results(ins, mismatch_at=None):
    """Result rows for a shard's input rows, as an actor returns them (no decoding)."""
    from dynatree.metrics import result_row

    out = []
    for j, r in enumerate(ins):
        row = result_row(r["id"], "dynatree")
        row.update(finish_reason="length", generated_text="x", generated_token_ids=[5, 6], num_generated_tokens=2,
                   matches_ar=j != mismatch_at, first_divergence=0 if j == mismatch_at else None)
        out.append(row)
    return out


def _begin(pair_dirs, tmp_path, texts=PROMPTS, **kw):
    """A job planned and its output prepared, as run_job does before it decodes."""
    from dynatree.jobs.plan import make_plan, prepare_output

    write_input(tmp_path, texts)
    job = spec(pair_dirs, tmp_path, **kw)
    plan = make_plan(job, quiet)
    return job, plan, prepare_output(job, plan)


def _write(job, plan, out, k, mismatch_at=None):
    from dynatree.jobs.driver import _read_shard, _shard_table
    from dynatree.jobs.plan import write_shard

    ins, kept = _read_shard(job, plan, k)
    write_shard(out, job, plan, k, _shard_table(plan, ins, _fake_results(ins, mismatch_at), kept))


def test_fail_on_mismatch_fails_the_job_after_writing_its_summary(pair_dirs, tmp_path):
    """--fail-on-mismatch: a checked row that differs from ar makes run_job raise MismatchError
    (only the CLI's handling of it was tested, with run_job mocked)."""
    from dynatree.jobs.driver import MismatchError

    job, plan, out = _begin(pair_dirs, tmp_path, PROMPTS[:4], fail_on_mismatch=True)
    _write(job, plan, out, 0, mismatch_at=2)  # every shard done: run_job decodes nothing, starts no Ray
    with pytest.raises(MismatchError, match="1 generation"):
        run_job(job, progress=False, log=quiet)
    assert json.loads((out / "summary.json").read_text())["equivalence"]["mismatches"] == 1
    s = run_job(dataclasses.replace(job, fail_on_mismatch=False), progress=False, log=quiet)
    assert s["equivalence"]["mismatches"] == 1  # without the flag the job succeeds


@pytest.mark.parametrize("fault", ["deleted", "damaged"])
def test_a_shard_deleted_or_damaged_while_the_job_runs_fails_it(pair_dirs, tmp_path, monkeypatch, fault):
    """A finished shard deleted while the job ran (a sync script moving results) ended "complete", exit
    0, its rows missing and runs.jsonl saying every shard was there; one damaged failed with pyarrow's
    bare "magic bytes" (trial AK).  A resume that decodes takes away the summary of the job it resumes
    (it counted rows no longer there: trials AJ, AK), and report then says the job is unfinished."""
    from click.testing import CliRunner

    from dynatree.cli import main
    from dynatree.jobs import driver, runs

    job, plan, out = _begin(pair_dirs, tmp_path, PROMPTS[:8])
    for k in range(plan.num_shards):
        _write(job, plan, out, k)
    assert run_job(job, progress=False, log=quiet)["rows"] == 8 and (out / "summary.json").is_file()

    def stopped_loading(self, todo, progress):
        raise KeyboardInterrupt

    monkeypatch.setattr(driver._Dispatch, "run", stopped_loading)  # (an --overwrite stopped before it cleared the
    with pytest.raises(KeyboardInterrupt):  # output leaves its summary: it was deleted, the review)
        run_job(dataclasses.replace(job, overwrite=True), progress=False, log=quiet)
    assert (out / "summary.json").is_file()
    (out / "shards" / "part-000001.parquet").unlink()

    def decode_while_one_goes(self, todo, progress):
        assert not (out / "summary.json").exists()
        for k in todo:
            _write(job, plan, out, k)
            self.stats.update(shards_this_run=1, rows_this_run=4)
        if fault == "deleted":
            (out / "shards" / "part-000000.parquet").unlink()
        else:
            (out / "shards" / "part-000000.parquet").write_bytes(b"PAR1 not a shard")

    monkeypatch.setattr(driver._Dispatch, "run", decode_while_one_goes)
    said = (r"1 shard file went missing while the job ran: part-000000; the same command decodes their rows again"
            if fault == "deleted" else r"part-000000.parquet cannot be read \(.*\): damaged since it was written\? the "
                                       r"same command decodes its rows again")
    with pytest.raises(JobError, match=said):
        run_job(job, progress=False, log=quiet)
    record = runs.read(out)[-1]
    assert record["status"] == "failed" and record["shards_done"] == (1 if fault == "deleted" else 2), record
    res = CliRunner().invoke(main, ["report", str(out)])
    assert res.exit_code == 1 and "the job has not finished" in res.output, res.output


def test_report_on_a_run_stopped_after_its_last_shard_or_finished_meanwhile(pair_dirs, tmp_path):
    """A run stopped once every shard was written read "not finished ... 2 of 2 shards are finished"
    (trial AM); a report made as the job finished said it unfinished (trial AN); a failed run's
    record said how to go on twice."""
    from click.testing import CliRunner

    from dynatree import cli
    from dynatree.jobs import runs

    job, plan, out = _begin(pair_dirs, tmp_path, PROMPTS[:8])
    for k in range(plan.num_shards):
        _write(job, plan, out, k)
    base = {"pid": 1, "host": "h", "started_at": "a", "ended_at": "b", "overwrite": False, "shards_done": 2,
            "shards_total": 2, "rows_done": 8, "rows_total": 8, "failed_shards": []}
    runs.append(out, {**base, "status": "interrupted", "message": ""})
    res = CliRunner().invoke(cli.main, ["report", str(out)])
    assert "every shard is finished; the same command writes the summary without decoding" in res.output, res.output
    runs.append(out, {**base, "status": "failed", "shards_done": 1, "rows_done": 4,
                      "message": "actor 0's replacement ...; finished shards are kept in x/shards — re-run to resume"})
    said = CliRunner().invoke(cli.main, ["report", str(out)]).output
    assert said.count("resume") == 1 and "1 of 2 shards (4 of 8 rows) are finished" in said, said
    run_job(job, progress=False, log=quiet)  # (finished between report's look for a summary and this one)
    assert cli._unfinished(str(out)) is None


def test_a_head_lost_as_the_last_shard_is_written_still_summarizes_the_job(pair_dirs, tmp_path, monkeypatch):
    """Every shard written, then the head gone: the job was said lost ("restart the head and
    re-run"), its summary unwritten; it is done, and summarized without its actors' statistics
    (the command exits without Ray's shutdown).  With shards failed, the head's loss is the error."""
    from dynatree.jobs import driver

    job, plan, out = _begin(pair_dirs, tmp_path, PROMPTS[:8])
    _write(job, plan, out, 0)

    def last_shard_then_gone(self, todo, progress):  # (what run() does once its loop has written the rest)
        for k in todo:
            _write(job, plan, out, k)
        self.failed, self.actors = [], ["an actor"]
        self._actor_stats(types.SimpleNamespace(get_runtime_context=lambda: types.SimpleNamespace(
            gcs_address="127.0.0.1:1")))  # (nothing listens on port 1)

    monkeypatch.setattr(driver._Dispatch, "run", last_shard_then_gone)
    with pytest.raises(driver.ClusterLost, match="every shard is finished and summarized") as e:
        run_job(job, progress=False, log=quiet)
    assert e.value.summary["rows"] == 8 and json.loads((out / "summary.json").read_text())["rows"] == 8
    d = driver._Dispatch.__new__(driver._Dispatch)
    d.failed, d.out, d.head_down_since = ["part-000001"], out, None
    with pytest.raises(driver.ClusterLost, match="restart the head and re-run"):
        d._actor_stats(types.SimpleNamespace(get_runtime_context=lambda: types.SimpleNamespace(gcs_address="127.0.0.1:1")))


def test_a_shard_write_cut_short_leaves_no_shard_file(pair_dirs, tmp_path, monkeypatch):
    """Shards are written atomically: a write that fails part-way (disk full, a kill) leaves no
    part-*.parquet that readers of out/shards would take for output."""
    from dynatree.jobs import plan as planmod

    job, plan, out = _begin(pair_dirs, tmp_path, PROMPTS[:4])

    def cut_short(table, where, **kw):
        with open(where, "wb") as f:
            f.write(b"PAR1 half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(planmod.pq, "write_table", cut_short)
    with pytest.raises(OSError, match=r"cannot write .*/shards/part-000000.parquet: No space left on device") as e:
        _write(job, plan, out, 0)  # (pyarrow's own message named no file: the corpus trial)
    assert e.value.errno == 28 and not (out / "shards" / "part-000000.parquet").exists()


def test_a_shard_file_for_another_range_is_not_taken_as_finished(pair_dirs, tmp_path):
    """A resume trusts a shard file only for exactly its planned rows: shard 0's file under shard
    1's name (same job identity) is redone, else ids k0..k3 appear twice and k4..k7 never."""
    job, plan, out = _begin(pair_dirs, tmp_path)
    for k in range(plan.num_shards):
        _write(job, plan, out, k)
    shutil.copy(out / "shards" / "part-000000.parquet", out / "shards" / "part-000001.parquet")
    got = run_job(job, progress=False, log=quiet, dry_run=True)
    assert (got["shards_done"], got["rows_to_decode"]) == (plan.num_shards - 1, 4)
    from dynatree.jobs.driver import _unfinished_files
    from dynatree.jobs.plan import finished_shards

    (out / "shards" / "part-000000.parquet").write_bytes(b"PAR1")  # (cut short: redone without a word, once)
    assert _unfinished_files(out, plan, finished_shards(out, job, plan)) == ["part-000000", "part-000001"]


def test_verify_fraction_picks_the_same_rows_in_every_process():
    """The AR check's rows are fixed by their ids: the same in every actor process, run and resume
    (Python's str hash is salted per process, PYTHONHASHSEED)."""
    code = ("from dynatree.actors.worker import verify_selected as v; ids = [f'k{i}' for i in range(300)]; "
            "print(''.join('1' if v(i, 0.3, k) else '0' for k in (0, 1) for i in ids))")
    got = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                          capture_output=True, text=True, check=True).stdout.strip() for seed in ("1", "2", "3")}
    assert len(got) == 1
    picks = got.pop()
    assert 0.2 < picks.count("1") / len(picks) < 0.4


def test_every_generating_field_is_part_of_the_output_identity(pair_dirs, tmp_path):
    """A resume with a field changed that changes what is generated must be refused: each such
    field, changed, changes identity_hash (listed here, not read from OUTPUT_IDENTITY)."""
    base = spec(pair_dirs, tmp_path)
    changed = {"ignore_eos": True, "max_prompt_tokens": 64, "max_new_tokens": 5, "dtype": "float32",
               "kernel": "hf", "method": "linear", "prompt_column": "key", "id_column": "text",
               "keep_columns": ("key",), "shard_size": 5, "verify_fraction": 0.5, "stop": ("x",),
               "stop_token_ids": (4,), "chat_template": True, "limit": 3, "options": {"d_max": 6},
               "input": str(tmp_path / "other.parquet")}
    same = [k for k, v in changed.items() if dataclasses.replace(base, **{k: v}).identity_hash() == base.identity_hash()]
    assert same == []


def test_retries_are_charged_only_to_the_shard_that_ran_alone(ray_cluster, pair_dirs, tmp_path, monkeypatch):
    """An actor death fails every shard in flight on it; only the shard that then fails alone
    spends its retries -- with --max-retries 0 the others still finish."""
    write_input(tmp_path)
    faults(monkeypatch, die_always_on_shard="part-000002")
    with pytest.raises(JobError, match=r"1 shard could not be decoded: part-000002 \(input rows .*\) failed after 1 attempt \(--max-retries 0\)"):
        run_job(spec(pair_dirs, tmp_path, max_retries=0, num_actors=1, batch_size=8, verify_fraction=0.0),
                progress=False, log=quiet)
    assert sorted(os.listdir(tmp_path / "out" / "shards")) == ["part-000000.parquet", "part-000001.parquet"]
    assert [r["id"] for r in read_rows(tmp_path / "out")] == [f"k{i}" for i in range(8)]


def test_row_index_ids_are_the_rows_of_the_whole_input(pair_dirs, tmp_path):
    """Without an id column a row's id is its index in the input, not in its shard: ids 0..11,
    never 0..3 three times."""
    from dynatree.jobs.driver import _read_shard
    from dynatree.jobs.plan import make_plan

    write_input(tmp_path)
    job = spec(pair_dirs, tmp_path, id_column=None)
    plan = make_plan(job, quiet)
    ids = [r["id"] for k in range(plan.num_shards) for r in _read_shard(job, plan, k)[0]]
    assert ids == [str(i) for i in range(len(PROMPTS))]


def test_this_runs_counts_are_the_rows_and_tokens_it_wrote(ray_cluster, pair_dirs, tmp_path):
    """summary.json's this_run: every output row (a prompt's samples each count) and every token
    of every shard this run wrote -- the same as the job's totals on a first run."""
    write_input(tmp_path, PROMPTS[:6])
    s = run_job(spec(pair_dirs, tmp_path, samples=2, options={"temperature": 0.9, "seed": 1}, shard_size=2,
                     num_actors=1, verify_fraction=0.0, max_new_tokens=4), progress=False, log=quiet)
    run = s["this_run"]
    assert (run["rows_this_run"], run["shards_this_run"], s["rows"]) == (12, 3, 12)
    assert run["tokens_this_run"] == s["generated_tokens"] > 0


def test_a_row_the_decoder_rejects_gets_that_error_and_the_others_go_on(pair_dirs, tmp_path, monkeypatch):
    """A request the scheduler resolves to its ValueError (BatchDecoder.add refused it) is that
    row's error -- not a row with no error, no text and no finish reason."""
    from dynatree.actors.worker import ShardWorker
    from dynatree.engine import BatchDecoder

    real = BatchDecoder.add

    def add(self, ids, *a, **kw):
        if kw["key"][1] == 1:  # the shard's second request
            raise ValueError("does not fit the context")
        return real(self, ids, *a, **kw)

    monkeypatch.setattr(BatchDecoder, "add", add)
    job = spec(pair_dirs, tmp_path, dtype="float32", batch_size=4, verify_fraction=0.0, max_new_tokens=4)
    results = ShardWorker(job, 1).run_shard("s0", [{"id": f"r{i}", "text": t} for i, t in enumerate(PROMPTS[:3])])
    assert [(r["error"], r["finish_reason"]) for r in results][1] == ("does not fit the context", "error")
    assert all(r["error"] is None and r["num_generated_tokens"] > 0 for r in (results[0], results[2]))


def test_a_run_that_decoded_nothing_is_not_the_last_decoding_run(tmp_path):
    """summary.json keeps the last run that decoded rows: a previous summary whose run decoded none
    (its shards were all written before the driver died) is not one."""
    from dynatree.jobs.summary import previous_decoding_run

    run = {"rows_this_run": 0, "tokens_this_run": 0, "shards_this_run": 0, "wall_time_s": 1.0}
    (tmp_path / "summary.json").write_text(json.dumps({"this_run": run, "startup": {"plan_s": 0.1}}))
    assert previous_decoding_run(tmp_path) is None
    run = {**run, "rows_this_run": 4, "tokens_this_run": 40}
    (tmp_path / "summary.json").write_text(json.dumps({"this_run": run, "startup": {"plan_s": 0.1}}))
    assert previous_decoding_run(tmp_path) == {"this_run": run, "startup": {"plan_s": 0.1}}


def test_a_local_job_beside_another_ray_cluster_warns_that_they_share_the_cores(tmp_path):
    """Another cluster's raylet on this machine: a local job's cluster counts every CPU as its own,
    and the two jobs' multi-thread forwards stall each other (measured 0.44x), so the driver says so."""
    import shutil
    import subprocess

    from dynatree.jobs import driver

    fake = tmp_path / "raylet"  # a process named as Ray's raylet is
    shutil.copy(shutil.which("sleep"), fake)
    proc = subprocess.Popen([str(fake), "60"])
    try:
        said = []
        driver._warn_if_shared(said.append)
        assert said and "raylet pid" in said[0] and str(proc.pid) in said[0], said
        assert "--cpus-per-actor" in said[0]
        proc.kill()
        time.sleep(0.2)  # a zombie now (not yet waited for): a dead raylet is no cluster
        said = []
        driver._warn_if_shared(said.append)
        assert not any(str(proc.pid) in m for m in said), said
    finally:
        proc.kill()
        proc.wait()


def test_ray_helpers_a_killed_job_left_are_named_with_their_pids(monkeypatch):
    """A SIGKILLed job leaves its cluster's agents (ppid 1, ~210 MB, deaf to SIGTERM): the next job
    names them (the failed-jobs trial: never mentioned again).  Another live cluster's are not."""
    import ray  # noqa: F401 -- (Ray's psutil)
    import psutil

    from dynatree.jobs import driver

    def proc(pid, cmd, ppid, name="python"):
        info = {"name": name, "status": "sleeping", "ppid": ppid, "cmdline": [cmd],
                "memory_info": types.SimpleNamespace(rss=100 * 2**20), "uids": types.SimpleNamespace(real=os.getuid())}
        return types.SimpleNamespace(pid=pid, info=info)

    procs = [proc(11, "ray::DashboardAgent", 1), proc(12, "ray::RuntimeEnvAgent", 1),
             proc(13, "ray::DashboardAgent", 500), proc(14, "python", 1)]  # (13: a live raylet's child)
    monkeypatch.setattr(psutil, "process_iter", lambda attrs=None: iter(procs))
    said = []
    driver._warn_if_shared(said.append)
    assert said == ["note: 2 Ray helper process(es) of a cluster that is gone hold 200 MiB (a job killed with SIGKILL "
                    "leaves them): `kill -9 11 12` frees it"], said


def test_a_local_jobs_memory_is_checked_against_what_ray_offers(pair_dirs, tmp_path, monkeypatch):
    """Ray offers a local cluster's memory less its object store (15.8 of 25.3 GB): a 20 GB
    request passed the check against the whole memory and failed only once Ray had started (the
    faults trial)."""
    import psutil  # (Ray's copy)
    import ray

    from dynatree.jobs import driver
    from dynatree.jobs.placement import local_memory

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # (as a job without a cluster of its caller)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    offered, total = local_memory(), psutil.virtual_memory().total
    assert 0 < offered < total
    with pytest.raises(JobError, match=r"lower --memory-per-actor"):
        driver._check_this_machine(spec(pair_dirs, tmp_path, num_actors=1, memory_per_actor=(offered + total) / 2e9))
    driver._check_this_machine(spec(pair_dirs, tmp_path, num_actors=1, memory_per_actor=offered / 2e9))  # fits


def test_a_local_jobs_gpus_are_counted_as_ray_counts_them(monkeypatch):
    """The GPUs a local cluster will offer: Ray's count, capped by the visible devices; --device
    cuda asks for NVIDIA's or AMD's only."""
    from ray._private import accelerators

    from dynatree.jobs.placement import local_gpus

    class Manager:
        visible = None

        def get_current_node_num_accelerators(self):
            return 4

        def get_current_process_visible_accelerator_ids(self):
            return self.visible

    class NoGPU(Manager):
        def get_current_node_num_accelerators(self):
            return 0

    m = Manager()
    monkeypatch.setattr(accelerators, "get_accelerator_manager_for_resource", lambda name: m)
    monkeypatch.setattr(accelerators, "NvidiaGPUAcceleratorManager", NoGPU())
    monkeypatch.setattr(accelerators, "AMDGPUAcceleratorManager", NoGPU())
    assert local_gpus() == 4
    m.visible = ["1", "3"]
    assert local_gpus() == 2
    assert local_gpus(cuda=True) == 0  # (Ray's GPUs here are another kind: Apple's, Intel's)
    monkeypatch.setattr(accelerators, "NvidiaGPUAcceleratorManager", m)
    assert local_gpus(cuda=True) == 2


def test_sigterm_to_the_process_group_ends_a_job_at_once(pair_dirs, tmp_path):
    """`timeout`, systemd and Slurm send SIGTERM to the driver's whole process group, where the
    local Ray cluster it started lives: releasing the actors then waited a minute for the dead head
    and Ray's client ended the process with status 1 and its own line (the corpus trial)."""
    import signal
    import subprocess
    import sys

    from dynatree.jobs.driver import own_cluster_died, zombie_children

    before = subprocess.Popen(["true"])  # (a child that exited before the signal: not the signal's doing)
    time.sleep(0.5)
    exited = zombie_children()
    assert before.pid in exited and not own_cluster_died(exited, settle_s=0.0)
    after = subprocess.Popen(["true"])  # (one that exited since: Ray's helpers do at once on the group's SIGTERM)
    assert own_cluster_died(exited, settle_s=0.5)
    before.wait(), after.wait()
    write_input(tmp_path, PROMPTS * 8)
    cmd = [sys.executable, "-m", "dynatree", "run", "--input", str(tmp_path / "in.parquet"), "--output",
           str(tmp_path / "out"), "--target", str(pair_dirs / "target"), "--draft", str(pair_dirs / "draft"),
           "--dtype", "float64", "--num-actors", "1", "--cpus-per-actor", "1", "--max-new-tokens", "12",
           "--shard-size", "4", "--batch-size", "1", "--quiet"]
    job = subprocess.Popen(cmd, start_new_session=True, stderr=subprocess.PIPE, text=True)
    said = []
    for line in job.stderr:  # (until its actor is ready: Ray and the cluster are up)
        said.append(line)
        if "actor(s) ready" in line:
            break
    t0 = time.time()
    os.killpg(job.pid, signal.SIGTERM)
    rest = job.stderr.read()
    job.wait(timeout=120)
    assert job.returncode == 143 and "terminated (SIGTERM):" in rest, "".join(said) + rest
    assert time.time() - t0 < 20 and "Failed to connect to GCS" not in rest


def test_a_jobs_context_is_the_targets_beside_a_shorter_draft(pair_dirs, tmp_path):
    """A draft's shorter context held a job to it (refused "in the draft's context"): the draft now
    restarts within its positions, so the job is held to the target's; a cache window, which both
    models keep, still to the shorter."""
    from dynatree.jobs.driver import check_models

    short = tmp_path / "short-draft"
    shutil.copytree(pair_dirs / "draft", short)
    config = json.loads((short / "config.json").read_text())
    target_ctx = json.loads((pair_dirs / "target" / "config.json").read_text())["max_position_embeddings"]
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16}))
    job = build_spec(None, input="x", output=str(tmp_path / "o"), target=str(pair_dirs / "target"), draft=str(short),
                     max_new_tokens=20)
    check_models(job)
    with pytest.raises(JobError, match=rf"--max-new-tokens {target_ctx} leaves no room for a prompt in the target's "
                                       rf"{target_ctx}-token context"):
        check_models(dataclasses.replace(job, max_new_tokens=target_ctx))
    with pytest.raises(JobError, match="kv_window 32 \\+ kv_evict 8 exceed the draft's 16-token context \\(a draft's "
                                       f"tree positions can reach their sum; a drafting method keeps the window in the draft too, "
                                       f"while ar's may fill the target's {target_ctx}\\)"):
        check_models(dataclasses.replace(job, options={"kv_window": 32, "kv_evict": 8}))
    check_models(dataclasses.replace(job, method="ar", options={"kv_window": 32, "kv_evict": 8}))  # (no draft runs)
