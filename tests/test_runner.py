"""The batch runner end to end on a real local Ray cluster, real Parquet files and tiny models."""
import json
import os

import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from dynatree.jobs.driver import JobError, run_job
from dynatree.jobs.spec import SpecError, build_spec
from dynatree.jobs.summary import read_rows

PROMPTS = ["The quick brown fox", "It was the best of times", "Call me Ishmael.", "Some years ago",
           "never mind how long", "The lazy dog", "it was the worst", "precisely the best",
           "quick quick brown", "Ishmael jumps over", "the times", "brown dog"]


@pytest.fixture(scope="module")
def ray_cluster():
    import ray
    # address="local": always a fresh private cluster, never one a `ray start` left registered
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False)
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
    assert sorted(os.listdir(tmp_path / "out" / "shards")) == [f"part-{i:05d}.parquet" for i in range(4)]
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["rows"] == len(texts)


def test_resume_redoes_only_unfinished_shards(ray_cluster, pair_dirs, tmp_path):
    write_input(tmp_path)
    run_job(spec(pair_dirs, tmp_path, verify_fraction=0.0), progress=False, log=quiet)
    shards = tmp_path / "out" / "shards"
    before = {f: os.stat(shards / f).st_mtime_ns for f in os.listdir(shards)}
    os.remove(shards / "part-00001.parquet")  # as if the driver died while it was in flight
    summary = run_job(spec(pair_dirs, tmp_path, verify_fraction=0.0), progress=False, log=quiet)
    assert summary["this_run"]["shards_this_run"] == 1 and summary["rows"] == len(PROMPTS)
    after = {f: os.stat(shards / f).st_mtime_ns for f in os.listdir(shards)}
    assert after["part-00000.parquet"] == before["part-00000.parquet"]
    assert after["part-00002.parquet"] == before["part-00002.parquet"]
    assert [r["id"] for r in read_rows(tmp_path / "out")] == [f"k{i}" for i in range(len(PROMPTS))]
    # a different config on the same directory is refused, unless overwrite
    with pytest.raises(JobError, match="different config .*max_new_tokens"):
        run_job(spec(pair_dirs, tmp_path, verify_fraction=0.0, max_new_tokens=5), progress=False, log=quiet)
    s = run_job(spec(pair_dirs, tmp_path, verify_fraction=0.0, max_new_tokens=5, overwrite=True),
                progress=False, log=quiet)
    assert s["this_run"]["shards_this_run"] == 3
    assert all(r["num_generated_tokens"] <= 5 for r in read_rows(tmp_path / "out"))


def test_actor_killed_mid_job_still_yields_exact_rows(ray_cluster, pair_dirs, tmp_path):
    write_input(tmp_path)
    s = run_job(spec(pair_dirs, tmp_path, fault_injection={"die_once_on_shard": "part-00001"}),
                progress=False, log=quiet)
    rows = read_rows(tmp_path / "out")
    assert [r["id"] for r in rows] == [f"k{i}" for i in range(len(PROMPTS))]
    assert s["this_run"]["retries"] >= 1 and s["equivalence"]["mismatches"] == 0
    assert (tmp_path / "out" / ".fault-part-00001").exists()


def test_retries_exhausted_fails_loudly_and_keeps_finished_shards(ray_cluster, pair_dirs, tmp_path):
    write_input(tmp_path)
    with pytest.raises(JobError, match="part-00002"):
        run_job(spec(pair_dirs, tmp_path, max_retries=1, verify_fraction=0.0,
                     fault_injection={"die_always_on_shard": "part-00002"}), progress=False, log=quiet)
    done = sorted(os.listdir(tmp_path / "out" / "shards"))
    assert "part-00002.parquet" not in done and "part-00000.parquet" in done


def test_batched_ar_job_matches_unbatched(ray_cluster, pair_dirs, tmp_path):
    write_input(tmp_path)
    s = run_job(spec(pair_dirs, tmp_path, method="ar", batch_size=3, num_actors=1), progress=False, log=quiet)
    assert s["equivalence"]["checked"] == len(PROMPTS) and s["equivalence"]["mismatches"] == 0


def test_jsonl_and_arrow_inputs(ray_cluster, pair_dirs, tmp_path):
    recs = [{"key": f"j{i}", "text": t} for i, t in enumerate(PROMPTS[:5])]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    feather.write_feather(pa.Table.from_pylist(recs), tmp_path / "in.arrow")
    for name in ("in.jsonl", "in.arrow"):
        out = tmp_path / f"out-{name}"
        s = run_job(spec(pair_dirs, tmp_path, input=str(tmp_path / name), output=str(out), num_actors=1),
                    progress=False, log=quiet)
        assert s["rows"] == 5 and s["equivalence"]["mismatches"] == 0
        assert [r["id"] for r in read_rows(out)] == [f"j{i}" for i in range(5)]


def test_bad_inputs_fail_before_any_work(pair_dirs, tmp_path):
    write_input(tmp_path)
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
    with pytest.raises(JobError, match="not writable"):
        run_job(spec(pair_dirs, tmp_path, output=str(tmp_path / "afile" / "out")), progress=False, log=quiet)
    with pytest.raises(JobError, match="no input files"):
        run_job(spec(pair_dirs, tmp_path, input=str(tmp_path / "missing*.parquet")), progress=False, log=quiet)
    assert not (tmp_path / "out" / "shards").exists() or not os.listdir(tmp_path / "out" / "shards")


def test_spec_validation_messages(tmp_path):
    with pytest.raises(SpecError, match="missing required field"):
        build_spec(None, input="x")
    with pytest.raises(SpecError, match="verify_fraction"):
        build_spec(None, input="x", output="y", verify_fraction=2)
    with pytest.raises(SpecError, match="only supported with method ar"):
        build_spec(None, input="x", output="y", batch_size=4)
    with pytest.raises(SpecError, match="no option 'depth'"):
        build_spec(None, input="x", output="y", options={"depth": "3"})
    job = tmp_path / "job.yaml"
    job.write_text("input: a.parquet\noutput: out\nmethod: fixed_tree\noptions: {depth: 3}\nbogus: 1\n")
    with pytest.raises(SpecError, match="unknown job field.*bogus"):
        build_spec(str(job))
    job.write_text("input: a.parquet\noutput: out\nmethod: fixed_tree\noptions: {depth: 3}\n")
    a = build_spec(str(job))
    b = build_spec(str(job), options={"depth": "3"})
    assert a.identity_hash() == b.identity_hash() and a.options == {"depth": 3}


def test_context_overflow_truncates_or_errors(ray_cluster, pair_dirs, tmp_path):
    long_text = " ".join(PROMPTS * 12)  # far more tokens than the 128-token context
    write_input(tmp_path, [long_text, "short one"])
    run_job(spec(pair_dirs, tmp_path, max_new_tokens=20, max_prompt_tokens=None, num_actors=1),
            progress=False, log=quiet)
    rows = read_rows(tmp_path / "out")
    assert rows[0]["error"] is None and rows[0]["prompt_tokens"] == 128 - 20
    assert rows[0]["num_generated_tokens"] <= 20 and rows[0]["matches_ar"] is True
    run_job(spec(pair_dirs, tmp_path, max_new_tokens=200, num_actors=1, overwrite=True), progress=False, log=quiet)
    rows = read_rows(tmp_path / "out")
    assert all("does not fit" in r["error"] for r in rows)


def test_example_job_files_are_valid_specs():
    from pathlib import Path
    for f in sorted((Path(__file__).resolve().parents[1] / "jobs" / "examples").glob("*.yaml")):
        spec = build_spec(str(f))
        assert spec.input and spec.output and spec.method


def test_sampled_job_reproducible_per_row(ray_cluster, pair_dirs, tmp_path):
    """temperature > 0: each row's sample depends on (seed, id) only, so a different sharding and
    actor count reproduce it; sampled rows are not compared with greedy ar."""
    write_input(tmp_path)
    opts = {"temperature": 0.9, "seed": 5}
    run_job(spec(pair_dirs, tmp_path, options=opts), progress=False, log=quiet)
    a = read_rows(tmp_path / "out")
    run_job(spec(pair_dirs, tmp_path, options=opts, output=str(tmp_path / "out2"), shard_size=5,
                 num_actors=1, method="dynatree"), progress=False, log=quiet)
    b = read_rows(tmp_path / "out2")
    assert [r["generated_token_ids"] for r in a] == [r["generated_token_ids"] for r in b]
    assert all(r["error"] is None and r["matches_ar"] is None for r in a)
    assert len({tuple(r["generated_token_ids"]) for r in a}) > 1
    with pytest.raises(SpecError, match="batch_size"):
        spec(pair_dirs, tmp_path, method="ar", batch_size=4, options=opts)
