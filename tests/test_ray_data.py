"""actors/ray_data.py: dynatree as a Ray Data stage -- rows decoded exactly as `generate` decodes
them, input columns carried through, per-row errors, options checked as a job's are."""
import asyncio
import os
import importlib.util
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dynatree import generate, load_pair
from dynatree.actors.ray_data import Generate, decoding_spec
from dynatree.jobs.driver import start_local_ray
from dynatree.jobs.spec import SpecError

_EXAMPLE = Path(__file__).resolve().parents[1] / "jobs" / "examples" / "ray_data_stage.py"
example = importlib.util.module_from_spec(importlib.util.spec_from_file_location("ray_data_stage", _EXAMPLE))
example.__spec__.loader.exec_module(example)

PROMPTS = ["The quick brown fox", "It was the best of times", "Call me Ishmael.", "Some years ago",
           "never mind how long", "The lazy dog", "it was the worst", "precisely the best"]


def options(pair_dirs, **kw):
    return dict(dict(target=str(pair_dirs / "target"), draft=str(pair_dirs / "draft"), method="dynatree",
                     max_new_tokens=10, dtype="float64", device="cpu", verify_fraction=1.0, batch_size=3), **kw)


def ar_tokens(pair_dirs, texts):
    pair = load_pair(str(pair_dirs / "target"), str(pair_dirs / "draft"), device="cpu", dtype="float64")
    return [generate(pair, t, "ar", max_new_tokens=10).token_ids for t in texts]


def test_a_batch_decodes_as_generate_does_and_keeps_its_columns(pair_dirs):
    udf = Generate(**options(pair_dirs))
    batch = pa.table({"text": PROMPTS[:3] + [None, "  ", None], "n": pa.array(range(6), pa.int16()),
                      "meta": [{"a": i} for i in range(6)]})
    out = asyncio.run(udf(batch))
    assert out.column_names[:2] == ["id", "generated_text"] and out.column_names[-3:] == ["text", "n", "meta"]
    assert out.schema.field("n").type == pa.int16() and out.column("meta").to_pylist()[4] == {"a": 4}
    rows = out.to_pylist()
    assert [r["generated_token_ids"] for r in rows[:3]] == ar_tokens(pair_dirs, PROMPTS[:3])
    assert all(r["matches_ar"] and r["error"] is None and r["id"] is None for r in rows[:3])
    assert [r["error"] for r in rows[3:]] == ["prompt is null", "prompt is empty or only whitespace", "prompt is null"]
    chat = asyncio.run(udf(pa.table({"text": [[{"role": "user", "content": "Hi"}]]}))).column("error").to_pylist()[0]
    assert "chat messages? run with chat_template=True" in chat and "--" not in chat, chat  # (the stage's option)
    # an id column: the id is the result's, as text
    out = asyncio.run(udf(pa.table({"id": [10, 11], "text": PROMPTS[3:5]})))
    assert out.column("id").to_pylist() == ["10", "11"] and "id" not in out.column_names[1:]
    assert out.column("generated_token_ids").to_pylist() == ar_tokens(pair_dirs, PROMPTS[3:5])
    assert udf.worker.scheduler.backlog >= 10**6  # auto's horizon: a stream, not the rows queued now


def test_without_ids_the_rows_checked_follow_the_prompt_not_its_place(pair_dirs):
    udf = Generate(**options(pair_dirs, verify_fraction=0.5))
    texts = PROMPTS + [p + " again" for p in PROMPTS]
    checked = [dict(zip(t, asyncio.run(udf(pa.table({"text": t}))).column("matches_ar").to_pylist()))
               for t in (texts, texts[::-1], texts[5:9])]
    assert 0 < sum(v is not None for v in checked[0].values()) < len(texts)
    assert checked[0] == checked[1] and all(checked[0][t] == checked[2][t] for t in texts[5:9])


def test_samples_repeat_their_prompts_columns_and_need_ids(pair_dirs):
    udf = Generate(**options(pair_dirs, samples=2, options={"temperature": 0.9}, id_column="key"))
    out = asyncio.run(udf(pa.table({"key": ["a", "b"], "text": PROMPTS[:2], "x": [1, 2]})))
    assert out.column("id").to_pylist() == ["a", "a", "b", "b"] and out.column("sample").to_pylist() == [0, 1, 0, 1]
    assert out.column("x").to_pylist() == [1, 1, 2, 2] and out.column("key").to_pylist() == ["a", "a", "b", "b"]
    again = asyncio.run(udf(pa.table({"key": ["b"], "text": PROMPTS[1:2], "x": [2]})))  # a seed follows the id
    assert again.column("generated_token_ids").to_pylist() == out.column("generated_token_ids").to_pylist()[2:]
    with pytest.raises(ValueError, match="sampling needs an id column"):
        asyncio.run(Generate(**options(pair_dirs, options={"temperature": 0.9}))(pa.table({"text": PROMPTS[:1]})))


def test_the_driver_side_check_finds_model_problems_before_any_actor(pair_dirs):
    from dynatree.actors.ray_data import check
    from dynatree.jobs.driver import JobError

    assert check(**options(pair_dirs), threads=2).method == "dynatree"
    with pytest.raises(JobError, match="^target /nonexistent/target: no such file"):  # (the option's name, not a flag's)
        check(**options(pair_dirs, target="/nonexistent/target"))
    with pytest.raises(JobError, match="^chat_template=True: ") as e:
        check(**options(pair_dirs, chat_template=True))
    assert "--" not in str(e.value), e.value
    from dynatree.actors.ray_data import stage_names
    assert stage_names("--max-new-tokens 2000 is past the context; give --option kv_window=N (see /a/b--c-d)") == \
        "max_new_tokens 2000 is past the context; give options kv_window=N (see /a/b--c-d)"
    assert stage_names("--stop-token-id 9 is outside; a node started with `ray start --resources '{\"a\": N}'` "
                       "has it") == ("stop_token_ids 9 is outside; a node started with `ray start --resources "
                                     "'{\"a\": N}'` has it")  # (a command to run kept whole: trial AL)
    with pytest.raises(SpecError, match="needs a draft: add draft, or run method ar") as e:  # (build_spec's too)
        check(**options(pair_dirs, draft=None))
    assert "--" not in str(e.value), e.value
    with pytest.raises(JobError, match="do not share a tokenizer"):
        check(**options(pair_dirs, draft=str(pair_dirs / "foreign")))
    with pytest.raises(SpecError, match="unknown option"):
        check(**options(pair_dirs, temprature=0.5))
    for bad in ("x", 0, -1, 1.5, True):  # (Generate(threads=-1) ran with one thread)
        with pytest.raises(SpecError, match=f"threads must be a positive integer .*got {bad!r}"):
            check(**options(pair_dirs), threads=bad)
    if not torch.cuda.is_available():  # not in every actor, later (this machine's, or a joined cluster's)
        with pytest.raises(JobError, match="^device cuda: (this machine has no CUDA GPU|the Ray cluster has no GPUs)"):
            check(**options(pair_dirs, device="cuda"))
    # options as a job file takes them: KEY=VALUE strings (one, or a list)
    assert check(**options(pair_dirs, options=["tau=0.05", "d_max=6"])).options == {"tau": 0.05, "d_max": 6}
    assert check(**options(pair_dirs, options="tau=0.05")).options == {"tau": 0.05}
    with pytest.warns(UserWarning, match=r"^top_k=4 changes nothing at temperature 0 \(greedy"):  # (said once, here)
        check(**options(pair_dirs, options={"top_k": 4}))
    with pytest.raises(SpecError, match="one KEY=VALUE per string; several as a list"):
        check(**options(pair_dirs, options="tau=0.05,d_max=6"))
    with pytest.raises(SpecError, match="options must be a mapping KEY: VALUE .* or a list of KEY=VALUE strings"):
        check(**options(pair_dirs, options=3))


def test_a_slow_dtype_on_a_cpu_is_said_by_the_stage(pair_dirs):
    """A job's driver says it once for the job and its actors stay quiet; a Ray Data stage has no
    such driver, and said nothing (the precision trial)."""
    with pytest.warns(UserWarning, match="float16 on a CPU runs torch's slow float16 kernels"):
        Generate(**options(pair_dirs, dtype="fp16", verify_fraction=0.0))


def test_check_refuses_a_pool_the_cluster_cannot_hold(pair_dirs, monkeypatch):
    """Ray Data waits for ever on such a pool (Ray's autoscaler's "No available node types can
    fulfill resource request" and nothing else); check(pool) says so before map_batches."""
    import ray

    from dynatree.actors.ray_data import check
    from dynatree.jobs.driver import JobError

    strategy = ray.data.ActorPoolStrategy
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": f"n{i}", "NodeManagerAddress": "10.0.0.1",
                                                "Resources": {"CPU": 2.0, "ssd": 1.0}} for i in (1, 2)])
    assert check(dict(num_cpus=1, compute=strategy(size=2)), **options(pair_dirs)).method == "dynatree"
    with pytest.raises(JobError, match=r"cannot place 3 actor\(s\) .*hold at most 2 .*lower "
                                       r"ActorPoolStrategy\(size=...\) to at most 2 or lower num_cpus") as e:
        check(dict(num_cpus=2, compute=strategy(min_size=3, max_size=4)), **options(pair_dirs))
    assert "--" not in str(e.value), e.value
    with pytest.raises(JobError, match="no node offers fast"):
        check(dict(concurrency=(1, 2), resources={"fast": 1}), **options(pair_dirs))
    with pytest.warns(UserWarning, match="take 4 of the cluster's 4 CPUs, so Ray Data's read and write tasks"):
        check(dict(num_cpus=2, concurrency=(2, 3)), **options(pair_dirs))  # (one that scales may give some back)
    for fixed in (dict(num_cpus=2, concurrency=2), dict(num_cpus=1, compute=strategy(size=4))):  # (waited for ever:
        with pytest.raises(JobError, match=r"take 4 of the cluster's 4 CPUs for the whole run, leaving none for Ray "
                                           r"Data's read and write tasks"):  # the example's --actors 2, trial AL)
            check(fixed, **options(pair_dirs))
    for pool, said in ((dict(num_cpus="1"), "pool num_cpus must be a number >= 0, got '1'"),
                       (dict(concurrency=0), r"pool concurrency must be .* got 0"),
                       (dict(concurrency=(3, 1)), r"pool concurrency must be .* got \(3, 1\)"),
                       (dict(resources={"ssd": "x"}), "pool resources must map names to amounts")):
        with pytest.raises(SpecError, match=said):
            check(pool, **options(pair_dirs))
    with pytest.raises(SpecError, match=r"num_cpus: map_batches' pool argument, given to check as its first argument"):
        check(num_cpus=1, **options(pair_dirs))
    with pytest.raises(SpecError, match="pool takes map_batches' .*got batch_size"):
        check(dict(batch_size=4), **options(pair_dirs))
    # Ray Data's own default (num_cpus=None: a CPU) and its other placement arguments, as map_batches takes them
    assert check(dict(num_cpus=None, compute=strategy(size=2), accelerator_type=None), **options(pair_dirs))
    with pytest.raises(JobError, match=r"cannot place 3 actor\(s\) × \{CPU: 2"):
        check(dict(concurrency=3, ray_remote_args={"num_cpus": 2}), **options(pair_dirs))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # Ray Data will start its cluster on this machine
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(JobError, match=r"this machine \(no ray.init before check"):
        check(dict(num_cpus=(os.cpu_count() or 1) + 1), **options(pair_dirs))


def test_a_full_node_on_a_cluster_with_room_is_only_a_may(monkeypatch, capsys):
    """On a cluster of small nodes each actor fills its own node: the pipeline that hangs (no CPU
    left anywhere) and the one that runs were warned alike (the two-node trial)."""
    import types

    import ray

    from dynatree.actors.ray_data import _warn_if_starving

    ctx = types.SimpleNamespace(get_assigned_resources=lambda: {"CPU": 1.0}, get_node_id=lambda: "n1")
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: ctx)
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": "n1", "Resources": {"CPU": 1.0}},
                                               {"NodeID": "n2", "Resources": {"CPU": 1.0}}])
    for free, said in ((1.0, "reserved all 1 CPUs of its node, so Ray Data's read and write tasks may not run"),
                       (0.0, "the cluster has less than one CPU left")):
        monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": free})
        _warn_if_starving()
        assert said in capsys.readouterr().err


def test_bad_options_and_batches_fail_clearly(pair_dirs):
    with pytest.raises(SpecError, match=r"num_actors \(use ActorPoolStrategy\(size=...\)\)"):
        decoding_spec(num_actors=2)
    with pytest.raises(SpecError, match="max_new_tokens must be >= 1"):
        decoding_spec(max_new_tokens=0)
    with pytest.raises(SpecError, match=r"unknown option\(s\) max_tokens \(max_tokens: did you mean max_new_tokens\?\); "
                                        r"the stage takes threads and .*max_new_tokens"):
        decoding_spec(max_tokens=5)
    with pytest.raises(SpecError, match=r"unknown option\(s\) max_tokens, temprature \(max_tokens: did you mean "
                                        r"max_new_tokens\?; temprature: the method's options=\{'temperature': ...\}\?\)"):
        decoding_spec(temprature=0.5, max_tokens=5)  # (each named: one hint did not hide the other)
    with pytest.raises(SpecError, match=r"unknown option\(s\) dpeth; the stage"):  # (fixed_tree's depth, not ar's)
        decoding_spec(method="ar", dpeth=3)
    assert decoding_spec(max_prompt_tokens=None).max_prompt_tokens is None  # (the whole context, not 512)
    udf = Generate(**options(pair_dirs))
    with pytest.raises(TypeError, match='batch_format="pyarrow"'):
        asyncio.run(udf({"text": ["x"]}))
    with pytest.raises(ValueError, match="no prompt column 'text'"):
        asyncio.run(udf(pa.table({"prompt": ["x"]})))
    with pytest.raises(ValueError, match="error, method would be overwritten"):
        asyncio.run(udf(pa.table({"text": ["x"], "error": [None], "method": ["m"]})))
    # a null or repeated id is that row's error, the others decode (one null id failed the whole dataset: the
    # Ray Data trial lost 299 good rows)
    got = asyncio.run(udf(pa.table({"text": ["x", "y", "z", "w"], "id": ["a", None, "a", "b"]}))).to_pylist()
    assert [r["error"] for r in got] == [None, "id column 'id': the id is null (ids key each row's seed and check: keep "
                                        "them unique)", "id column 'id': id a repeats an earlier row's in this batch "
                                        "(ids key each row's seed and check: keep them unique)", None]
    assert [r["finish_reason"] == "error" for r in got] == [False, True, True, False]
    assert [r["id"] for r in got] == ["a", None, "a", "b"] and got[3]["generated_text"]


def test_a_lost_device_ends_the_actor_so_ray_data_replaces_it(pair_dirs, monkeypatch):
    import os

    from dynatree import engine

    udf = Generate(**options(pair_dirs))

    def lost(self, rows):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def exit_(code):
        raise SystemExit(code)

    monkeypatch.setattr(engine.BatchDecoder, "_iterate", lost)
    monkeypatch.setattr(os, "_exit", exit_)
    with pytest.raises(SystemExit):
        asyncio.run(udf(pa.table({"text": PROMPTS[:2]})))


def test_a_ray_data_pipeline_reads_decodes_and_writes_every_row(pair_dirs, tmp_path):
    """jobs/examples/ray_data_stage.py: Parquet in, a pool of one actor holding several batches at
    once, Parquet out -- every row once, the text `generate` gives, the input's columns beside it."""
    pq.write_table(pa.table({"key": [f"k{i}" for i in range(len(PROMPTS))], "text": PROMPTS,
                             "source": ["wiki"] * len(PROMPTS)}), tmp_path / "in.parquet", row_group_size=3)
    ray = start_local_ray(num_cpus=2, log_to_driver=False)

    @ray.remote
    def probe(patience: float = 1.0) -> str:  # (a task holding num_cpus, as the stage's actor does)
        import contextlib
        import io
        import time

        from dynatree.actors.ray_data import _warn_if_starving

        t0 = time.monotonic()
        while True:  # (the stage checks once its pair has loaded: Ray's view of free CPUs lags)
            time.sleep(0.25)
            out = io.StringIO()
            with contextlib.redirect_stderr(out):
                _warn_if_starving()
            if out.getvalue() or time.monotonic() - t0 > patience:
                return out.getvalue()

    try:
        example.pipeline(str(tmp_path / "in.parquet"), str(tmp_path / "out"), batch_rows=2,
                         **options(pair_dirs, id_column="key"))
        said = [ray.get(probe.options(num_cpus=c).remote()) for c in (1, 2)]
        holder = ray.remote(num_cpus=1)(type("Holder", (), {"ready": lambda self: True})).remote()
        ray.get(holder.ready.remote())  # (another actor of the pool, holding the other CPU)
        said.append(ray.get(probe.options(num_cpus=1).remote(10.0)))
    finally:
        ray.shutdown()
    assert said[0] == "" and "less than one CPU left" in said[1]  # (a pipeline would wait for ever)
    assert "less than one CPU left" in said[2]
    rows = sorted(pq.read_table(tmp_path / "out").to_pylist(), key=lambda r: int(r["id"][1:]))
    assert [r["id"] for r in rows] == [f"k{i}" for i in range(len(PROMPTS))]
    assert [r["generated_token_ids"] for r in rows] == ar_tokens(pair_dirs, PROMPTS)
    assert all(r["matches_ar"] and r["source"] == "wiki" and r["text"] == p for r, p in zip(rows, PROMPTS))
