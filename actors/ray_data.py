"""dynatree as a Ray Data stage: a stateful batch UDF for ``Dataset.map_batches``.

    ds = ray.data.read_parquet("prompts/")
    ds = ds.map_batches(Generate, fn_constructor_kwargs={"target": ..., "draft": ..., "method": "dynatree"},
                        batch_size=16, num_cpus=2,
                        compute=ray.data.ActorPoolStrategy(size=2, max_concurrent_calls_per_actor=4))
    ds.write_parquet("out/")

Each actor loads its pair once (:class:`~dynatree.actors.worker.ShardWorker`, the job runner's
worker) and decodes the rows of every batch it holds in one batched engine: ``__call__`` is a
coroutine, so Ray Data hands an actor several batches at once (four of a block's; blocks at once:
``max_concurrent_calls_per_actor``) and they share forwards -- the engine's batch stays full across
Ray Data's batches and blocks.

Output rows: the result columns of ``dynatree run`` (metrics.output_schema: generated text and
token ids, finish reason, per-row metrics, ``error``), then every input column (a row's samples
each carry their prompt's).  Errors as in a job: the pair cannot load -- fatal, raised from the
constructor (Ray Data fails the dataset); a prompt that is null, empty, not text, or cannot fit --
that row's ``error``, the others decode.

Options are ``dynatree run``'s (JobSpec fields, validated the same way) that say what is decoded;
those that spread a job over a cluster are Ray Data's here (``concurrency``, ``num_cpus``,
``num_gpus``, ``memory`` of ``map_batches``) and are refused by name.
"""
from __future__ import annotations

import asyncio
import sys

import pyarrow as pa

from dynatree.data import id_strings
from dynatree.jobs.spec import JobSpec, SpecError, build_spec
from dynatree.metrics import output_schema
from dynatree.parts import py_values

# JobSpec fields that spread a job over actors and files: Ray Data's own settings do that here
_JOB_ONLY = {"input": "the dataset", "output": "write_parquet or any Ray Data sink",
             "limit": "ds.limit(n)", "keep_columns": "ds.select_columns / drop_columns (all input columns are kept)",
             "num_actors": "map_batches(concurrency=...)", "cpus_per_actor": "map_batches(num_cpus=...)",
             "gpus_per_actor": "map_batches(num_gpus=...)", "memory_per_actor": "map_batches(memory=...)",
             "shard_size": "map_batches(batch_size=...)", "max_inflight_per_actor": "map_batches(max_concurrency=...)",
             "max_retries": "Ray Data's own retries (DataContext)", "fail_on_mismatch": "the matches_ar column",
             "address": "ray.init(address=...)", "placement_timeout_s": "Ray Data's scheduling",
             "ready_timeout_s": "Ray Data's scheduling", "resume": "Ray Data's sinks", "overwrite": "Ray Data's sinks"}
# an id for the engine: it keys a sampled row's seed and the rows --verify-fraction picks
_STREAM = "ray-data"
_HORIZON = 10**9  # rows still to come, as the batch tuner hears it: a stream's length is unknown


def decoding_spec(**options) -> JobSpec:
    """A JobSpec of the decoding ``options`` (JobSpec field names); SpecError for a job-only one."""
    job_only = sorted(set(options) & set(_JOB_ONLY))
    if job_only:
        raise SpecError("not options of a Ray Data stage: " + "; ".join(f"{k} (use {_JOB_ONLY[k]})" for k in job_only))
    return build_spec(None, input=_STREAM, output=_STREAM, **options)


class Generate:
    """Ray Data stateful batch UDF: input batch (pyarrow, pandas or dict of arrays) -> a pyarrow
    Table of result columns then the input's columns, ``samples`` rows per input row."""

    def __init__(self, threads: int | None = None, **options):
        """``threads``: torch threads (default: the CPUs Ray reserved for the actor -- fewer than a
        node has, so Ray Data's read and write tasks can run beside it); ``options``: JobSpec fields."""
        from . import ray_actor
        from .worker import ShardWorker

        spec = ray_actor.placed(decoding_spec(**options))
        self.spec = spec
        _warn_if_starving()
        self.worker = ShardWorker(spec, threads or ray_actor.assigned_cpus())
        self.worker.scheduler.tell_backlog(_HORIZON)
        self.sampled = spec.method_config.temperature > 0
        self.schema = output_schema(spec.samples > 1)

    async def __call__(self, batch) -> pa.Table:
        table = _as_table(batch)
        id_col = self._check(table.column_names)
        ids = id_strings(table.column(id_col)) if id_col else [str(i) for i in range(table.num_rows)]
        if None in ids:
            raise ValueError(f"dynatree: id column {id_col!r} holds a null (ids key each row's seed and check)")
        rows = [{"id": i, "text": t} for i, t in zip(ids, py_values(table.column(self.spec.prompt_column)))]
        results = await asyncio.to_thread(self.worker.run_shard, _STREAM, rows)
        out = pa.Table.from_pylist(results, schema=self.schema)
        if id_col is None:  # the engine's ids were the rows' positions in the batch: none to show
            out = out.set_column(self.schema.get_field_index("id"), "id", pa.nulls(len(results), pa.string()))
        n = self.spec.samples
        carried = table if n == 1 else table.take(pa.array([i for i in range(len(rows)) for _ in range(n)], pa.int64()))
        for name in carried.column_names:
            if name != "id":  # (an input id is the result's id column, as text)
                out = out.append_column(carried.schema.field(name), carried.column(name))
        return out

    def _check(self, names: list[str]) -> str | None:
        """The batch's id column (None: none); ValueError for a batch no row of which can decode."""
        spec = self.spec
        if spec.prompt_column not in names:
            raise ValueError(f"dynatree: the batch has no prompt column {spec.prompt_column!r} "
                             f"(columns: {', '.join(names)}; option prompt_column)")
        id_col = spec.id_column or ("id" if "id" in names else None)
        if id_col is not None and id_col not in names:
            raise ValueError(f"dynatree: the batch has no id column {id_col!r} (columns: {', '.join(names)})")
        clash = [c for c in names if c in self.schema.names and c != "id" or c == "id" and id_col != "id"]
        if clash:
            raise ValueError(f"dynatree: input column(s) {', '.join(clash)} would be overwritten by result columns "
                             "of the same name; rename or drop them first (ds.rename_columns / drop_columns)")
        if id_col is None and self.sampled:
            raise ValueError("dynatree: sampling needs an id column (option id_column, or a column named id): a "
                             "row's seed comes from its id, so that it does not depend on how Ray Data batches rows")
        return id_col


def _warn_if_starving() -> None:
    """Say so where this actor holds every CPU of its node: Ray Data's read and write tasks cannot
    run there, and on a one-node cluster the pipeline then waits for ever without a message."""
    import ray

    if not ray.is_initialized():
        return
    ctx = ray.get_runtime_context()
    mine = ctx.get_assigned_resources().get("CPU", 0)
    node = next((n for n in ray.nodes() if n.get("NodeID") == ctx.get_node_id()), {})
    total = node.get("Resources", {}).get("CPU", 0)
    if mine and mine >= total:
        print(f"dynatree Generate: WARNING this actor reserved all {total:g} CPUs of its node, so Ray Data's read "
              "and write tasks cannot run beside it (a one-node pipeline waits for ever): reserve fewer "
              "(map_batches num_cpus) and keep the threads (Generate's threads option)", file=sys.stderr, flush=True)


def _as_table(batch) -> pa.Table:
    if isinstance(batch, pa.Table):
        return batch
    if isinstance(batch, dict):
        return pa.table({k: pa.array(list(v)) if not isinstance(v, pa.Array) else v for k, v in batch.items()})
    return pa.Table.from_pandas(batch, preserve_index=False)  # a pandas DataFrame
