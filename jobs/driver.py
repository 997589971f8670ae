"""The batch driver: reads prompts, shards them over Ray actors, writes Parquet, resumes.

The driver never touches tensors: it moves ``{"id", "text"}`` rows to actors and result rows
(plain Python values) back to Parquet.

Output directory::

    OUT/manifest.json            job identity, spec and shard plan (written before any work)
    OUT/shards/part-NNNNN.parquet one file per shard, written to a temp name then renamed
    OUT/summary.json             throughput, acceptance, equivalence, errors, config, versions

A shard file exists only when complete, so a killed driver loses at most the shards in
flight; re-running on the same directory skips finished shards.  A re-run whose output
identity differs (see ``spec.OUTPUT_IDENTITY``) is refused unless ``overwrite``.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections import deque
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dynatree.data import InputError, read_table

from .spec import JobSpec
from .summary import summarize, write_summary

SCHEMA = pa.schema([
    ("id", pa.string()), ("prompt_tokens", pa.int32()), ("generated_text", pa.string()),
    ("generated_token_ids", pa.list_(pa.int32())), ("num_generated_tokens", pa.int32()),
    ("finish_reason", pa.string()), ("method", pa.string()), ("error", pa.string()),
    ("tokens_per_s", pa.float64()), ("wall_time_s", pa.float64()), ("ttft_s", pa.float64()),
    ("tpot_s", pa.float64()), ("iterations", pa.int32()), ("tokens_per_iteration", pa.float64()),
    ("avg_path_length", pa.float64()), ("acceptance_rate", pa.float64()),
    ("draft_time_s", pa.float64()), ("verify_time_s", pa.float64()), ("target_forwards", pa.int32()),
    ("draft_forwards", pa.int32()), ("lookup_tokens", pa.int32()), ("ar_tokens_per_s", pa.float64()), ("matches_ar", pa.bool_()),
    ("first_divergence", pa.int32()), ("divergence_margin", pa.float64()),
])


class JobError(RuntimeError):
    """The job cannot start or did not finish."""


def load_prompts(spec: JobSpec) -> list[dict]:
    """[{"id": str, "text": any}] in input order; bad files, columns and duplicate ids fail here."""
    try:
        table = read_table(spec.input)
    except InputError as e:
        raise JobError(str(e)) from e
    cols = table.column_names
    if spec.prompt_column not in cols:
        raise JobError(f"input {spec.input}: no prompt column {spec.prompt_column!r} (columns: {', '.join(cols)})")
    texts = table.column(spec.prompt_column).to_pylist()
    if spec.id_column:
        if spec.id_column not in cols:
            raise JobError(f"input {spec.input}: no id column {spec.id_column!r} (columns: {', '.join(cols)})")
        ids = table.column(spec.id_column).to_pylist()
        if any(i is None for i in ids):
            raise JobError(f"input {spec.input}: id column {spec.id_column!r} has null ids")
        ids = [str(i) for i in ids]
        seen, dups = set(), []
        for i in ids:
            if i in seen:
                dups.append(i)
            seen.add(i)
        if dups:
            raise JobError(f"input {spec.input}: duplicate ids in {spec.id_column!r}: {', '.join(sorted(set(dups))[:10])}")
    else:
        ids = [str(i) for i in range(len(texts))]
    return [{"id": i, "text": t} for i, t in zip(ids, texts)]


def plan_shards(n_rows: int, shard_size: int) -> list[tuple[str, int, int]]:
    return [(f"part-{k:05d}", s, min(s + shard_size, n_rows))
            for k, s in enumerate(range(0, n_rows, shard_size))]


def prepare_output(spec: JobSpec, shards: list) -> Path:
    out = Path(spec.output)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "shards").mkdir(exist_ok=True)
        probe = out / ".write-probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise JobError(f"output directory {out} is not writable: {e}") from e
    manifest_path = out / "manifest.json"
    manifest = {"identity_hash": spec.identity_hash(), "identity": spec.identity(),
                "shards": [{"name": n, "start": s, "end": e} for n, s, e in shards]}
    if manifest_path.exists():
        old = json.loads(manifest_path.read_text())
        if spec.overwrite:
            shutil.rmtree(out / "shards")
            (out / "shards").mkdir()
            for f in out.glob(".fault-*"):
                f.unlink()
        elif old.get("identity_hash") != manifest["identity_hash"]:
            changed = sorted(k for k in manifest["identity"]
                             if json.dumps(manifest["identity"][k], default=str)
                             != json.dumps(old.get("identity", {}).get(k), default=str))
            raise JobError(f"{out} holds a job with a different config (changed: {', '.join(changed)}); "
                           "use --overwrite to replace it or another --output")
        elif not spec.resume:
            raise JobError(f"{out} already holds this job; pass --resume to continue it or --overwrite")
    elif any((out / "shards").iterdir()):
        raise JobError(f"{out}/shards has files but no manifest; refusing to mix outputs (use --overwrite)")
    tmp = manifest_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, default=str))
    os.replace(tmp, manifest_path)
    return out


def shard_done(out: Path, name: str, n_rows: int) -> bool:
    path = out / "shards" / f"{name}.parquet"
    if not path.exists():
        return False
    try:
        return pq.ParquetFile(path).metadata.num_rows == n_rows
    except Exception:  # a damaged file is redone
        return False


def write_shard(out: Path, name: str, rows: list[dict]) -> None:
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    final = out / "shards" / f"{name}.parquet"
    tmp = final.with_name(f".{name}.parquet.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, final)  # atomic: a shard file is either absent or complete


def _progress(total: int):
    try:
        from tqdm import tqdm
        return tqdm(total=total, unit="row", file=sys.stderr, dynamic_ncols=True, smoothing=0.1)
    except ImportError:
        return None


def _init_ray(spec: JobSpec):
    import ray

    if not ray.is_initialized():
        if spec.address or os.environ.get("RAY_ADDRESS"):  # RAY_ADDRESS: inside `ray job submit`
            ray.init(address=spec.address, log_to_driver=True)
        else:
            # a private local cluster on loopback ("local": never attach to a cluster some earlier
            # `ray start` left registered); the dashboard is not needed for `dynatree run`
            ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1",
                     log_to_driver=True)
    return ray


def _actor_shape(spec: JobSpec, resources: dict) -> tuple[int, float, float]:
    gpus = spec.gpus_per_actor
    if gpus is None:
        gpus = 1.0 if resources.get("GPU", 0) >= 1 and spec.device != "cpu" else 0.0
    if spec.num_actors is not None:
        n = spec.num_actors
    elif gpus > 0:
        n = max(1, int(resources.get("GPU", 0) // gpus))
    else:
        n = max(1, int(resources.get("CPU", 1) // spec.cpus_per_actor))
    return n, spec.cpus_per_actor, gpus


def run_job(spec: JobSpec, *, progress: bool = True, log=print) -> dict:
    """Run (or resume) a job; returns the summary.  Raises JobError on fatal problems."""
    t_start = time.time()
    rows = load_prompts(spec)
    shards = plan_shards(len(rows), spec.shard_size)
    out = prepare_output(spec, shards)
    todo = [s for s in shards if not shard_done(out, s[0], s[2] - s[1])]
    if len(todo) < len(shards):
        log(f"resuming: {len(shards) - len(todo)} of {len(shards)} shards already done")
    run_stats = {"rows_this_run": 0, "tokens_this_run": 0, "shards_this_run": 0, "retries": 0}
    if todo:
        _run_shards(spec, out, rows, todo, run_stats, progress, log)
    run_stats["wall_time_s"] = time.time() - t_start
    summary = summarize(out, spec, run_stats)
    write_summary(out, summary)
    if spec.fail_on_mismatch and summary["equivalence"]["mismatches"]:
        raise JobError(f"{summary['equivalence']['mismatches']} generation(s) differ from ar "
                       f"(--fail-on-mismatch); see summary.json")
    return summary


def _run_shards(spec: JobSpec, out: Path, rows: list[dict], todo: list, stats: dict, progress: bool, log):
    ray = _init_ray(spec)
    from ray.exceptions import RayActorError, RayTaskError

    from dynatree.actors.ray_actor import PairActor

    n_actors, cpus, gpus = _actor_shape(spec, ray.cluster_resources())
    n_actors = min(n_actors, len(todo))
    job = spec.to_dict()
    threads = max(1, int(cpus))

    def start_actor():
        return PairActor.options(num_cpus=cpus, num_gpus=gpus, max_restarts=0).remote(job, threads)

    actors = [start_actor() for _ in range(n_actors)]
    try:
        infos = ray.get([a.ready.remote() for a in actors])
    except (RayActorError, RayTaskError) as e:
        for a in actors:
            ray.kill(a)
        raise JobError(f"actors could not load the model pair: {e}") from e
    log(f"{n_actors} actor(s) ready: {infos[0]['device']}, {infos[0]['dtype']}, "
        f"{cpus:g} CPU / {gpus:g} GPU each, context {infos[0]['context']}")

    pending = deque(todo)
    attempts: dict[str, int] = {}
    inflight: dict = {}  # ref -> (slot, actor handle, shard)
    failed: list[str] = []
    bar = _progress(sum(e - s for _, s, e in todo)) if progress else None
    t0 = time.time()
    try:
        while pending or inflight:
            for slot, actor in enumerate(actors):
                busy = sum(1 for v in inflight.values() if v[0] == slot)
                while pending and busy < spec.max_inflight_per_actor:
                    shard = pending.popleft()
                    name, s, e = shard
                    inflight[actor.run_shard.remote(name, rows[s:e])] = (slot, actor, shard)
                    busy += 1
            done, _ = ray.wait(list(inflight), num_returns=1)
            for ref in done:
                slot, actor, shard = inflight.pop(ref)
                name, s, e = shard
                try:
                    result = ray.get(ref)
                except (RayActorError, RayTaskError) as err:
                    attempts[name] = attempts.get(name, 0) + 1
                    stats["retries"] += 1
                    actor_died = isinstance(err, RayActorError)
                    if attempts[name] > spec.max_retries:
                        failed.append(name)
                        log(f"shard {name} failed {attempts[name]} times; giving up: {str(err).splitlines()[0]}")
                    else:
                        log(f"shard {name} failed ({'actor died' if actor_died else 'task error'}); "
                            f"retry {attempts[name]}/{spec.max_retries}")
                        pending.appendleft(shard)
                    if actor_died and actors[slot] is actor:  # replace a dead actor once
                        actors[slot] = start_actor()
                    continue
                write_shard(out, name, result)
                toks = sum(r["num_generated_tokens"] or 0 for r in result)
                stats["rows_this_run"] += len(result)
                stats["tokens_this_run"] += toks
                stats["shards_this_run"] += 1
                if bar is not None:
                    bar.update(len(result))
                    bar.set_postfix_str(f"{stats['tokens_this_run'] / (time.time() - t0):.1f} tok/s")
    finally:
        if bar is not None:
            bar.close()
        for a in actors:
            ray.kill(a)
    if failed:
        raise JobError(f"shard(s) failed after {spec.max_retries} retries: {', '.join(sorted(failed))}; "
                       f"finished shards are kept in {out}/shards — re-run to retry the rest")
