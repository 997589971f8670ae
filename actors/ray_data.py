"""dynatree as a Ray Data stage: a stateful batch UDF for ``Dataset.map_batches``.

    ds = ray.data.read_parquet("prompts/")
    ds = ds.map_batches(Generate, batch_size=16, batch_format="pyarrow", num_cpus=1,
                        fn_constructor_kwargs={"target": ..., "draft": ..., "method": "dynatree", "threads": 2},
                        compute=ray.data.ActorPoolStrategy(size=1, max_concurrent_calls_per_actor=4))
    ds.write_parquet("out/")

(jobs/examples/ray_data_stage.py runs it, after :func:`check`.)  An actor's CPUs stay below its node's: Ray Data's own
tasks take a CPU each, and actors holding them all starve the pipeline (``_warn_if_starving``).

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
those that spread a job over a cluster are Ray Data's here (``ActorPoolStrategy``, ``num_cpus``,
``num_gpus``, ``memory`` of ``map_batches``) and are refused by name.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import operator
import os
import re
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa

from dynatree.config import METHODS, close_names, unused_options
from dynatree.data import id_strings
from dynatree.jobs.spec import FLAG_FIELDS, JobSpec, SpecError, build_spec
from dynatree.metrics import output_schema
from dynatree.parts import each_repeated, py_values

from .ray_actor import assigned_cpus, exit_if_broken, placed

# JobSpec fields that spread a job over actors and files: Ray Data's own settings do that here
_JOB_ONLY = {"input": "the dataset", "output": "write_parquet or any Ray Data sink",
             "limit": "ds.limit(n)", "keep_columns": "ds.select_columns / drop_columns (all input columns are kept)",
             "num_actors": "ActorPoolStrategy(size=...)", "cpus_per_actor": "map_batches(num_cpus=...)",
             "gpus_per_actor": "map_batches(num_gpus=...)", "memory_per_actor": "map_batches(memory=...)",
             "resources_per_actor": "map_batches(resources=...)",
             "shard_size": "map_batches(batch_size=...)",
             "max_inflight_per_actor": "ActorPoolStrategy(max_concurrent_calls_per_actor=...)",
             "max_retries": "Ray Data's own retries (DataContext)", "fail_on_mismatch": "the matches_ar column",
             "address": "ray.init(address=...)", "placement_timeout_s": "Ray Data's scheduling",
             "ready_timeout_s": "Ray Data's scheduling", "resume": "Ray Data's sinks", "overwrite": "Ray Data's sinks"}
_STREAM = "ray-data"  # the spec's input and output, and the worker's shard name
_HORIZON = 10**9  # rows still to come, as the batch tuner hears it: a stream's length is unknown
_SWITCHES = {f.name for f in dataclasses.fields(JobSpec) if isinstance(f.default, bool)}  # (stage_names)
_CALLS = 256  # threads waiting on the worker at once: every batch Ray Data hands the actor


def decoding_spec(**options) -> JobSpec:
    """A JobSpec of the decoding ``options`` (JobSpec field names); SpecError for a job-only or
    unknown one.  None is kept where a field takes it (max_prompt_tokens=None: the whole context)."""
    fields = {f.name for f in dataclasses.fields(JobSpec)}
    job_only = sorted(set(options) & set(_JOB_ONLY))
    if job_only:
        raise SpecError("not options of a Ray Data stage: " + "; ".join(f"{k} (use {_JOB_ONLY[k]})" for k in job_only))
    unknown = sorted(set(options) - fields)
    if unknown:
        stage = fields - set(_JOB_ONLY)
        chosen = METHODS.get(options.get("method", "dynatree"))  # (options={...}'s keys: the method's)
        method = {f.name for c in ([chosen] if chosen else METHODS.values()) for f in dataclasses.fields(c)}
        near = {w: close_names([w], stage) or close_names([w], method) for w in unknown}
        said = [f"{w}: did you mean {c[0]}?" if c[0] in stage else f"{w}: the method's options={{'{c[0]}': ...}}?"
                for w, c in near.items() if c]
        said += [f"{w}: map_batches' pool argument, given to check as its first argument (check({{'{w}': ...}}, "
                 "...))" for w in unknown if w in _POOL | _POOL_UNCHECKED]
        hint = f" ({'; '.join(said)})" if said else ""
        raise SpecError(f"unknown option(s) {', '.join(unknown)}{hint}; the stage takes threads and "
                        f"{', '.join(sorted(stage))}, and a method's options as options={{KEY: VALUE}}")
    spec = build_spec(None, input=_STREAM, output=_STREAM, **options)  # (which drops None: a flag not given)
    nones = {k: None for k, v in options.items() if v is None}
    return dataclasses.replace(spec, **nones) if nones else spec


def check(pool: dict | None = None, **options) -> JobSpec:
    """In the driver, before ``map_batches``: the options as the stage takes them, and what a job's
    driver checks before any actor starts (model paths, shared tokenizer, context, stop ids) --
    SpecError / JobError now, rather than in every actor once Ray Data has started them.

    ``pool``: map_batches' pool arguments (``compute`` or ``concurrency``, ``num_cpus``, ``num_gpus``,
    ``memory``, ``resources``), checked against the cluster (the one ``ray.init`` joined, else this
    machine): a pool it cannot hold waits for ever in Ray Data, so it is a JobError here."""
    from dynatree.jobs.driver import JobError, check_models

    _threads(options.get("threads"))
    try:  # (build_spec's words are the job runner's: "add --draft", trial AL)
        spec = decoding_spec(**{k: v for k, v in options.items() if k != "threads"})
    except SpecError as e:
        raise SpecError(stage_names(str(e))) from e
    try:
        check_models(spec)
        _check_device(spec)
        if pool is not None:
            _check_pool(pool)
    except JobError as e:
        raise JobError(stage_names(str(e))) from e
    if note := unused_options(spec.method_config):  # (here once, not in every actor)
        warnings.warn(stage_names(note), stacklevel=2)
    return spec


_POOL = {"compute", "concurrency", "num_cpus", "num_gpus", "memory", "resources"}  # (check's pool=: what it checks)
_POOL_UNCHECKED = {"ray_remote_args", "accelerator_type", "label_selector", "scheduling_strategy"}  # (map_batches' too)
_POOL_FLAGS = {"--num-actors": "ActorPoolStrategy(size=...)", "--cpus-per-actor": "num_cpus",
               "--gpus-per-actor": "num_gpus", "--memory-per-actor": "memory"}


def _pool_size(pool: dict) -> int:
    """The actors a pool starts with: ActorPoolStrategy's min_size, or concurrency's (n or (min, max))."""
    if (compute := pool.get("compute")) is not None:
        return int(getattr(compute, "min_size", None) or 1)
    concurrency = pool.get("concurrency") or 1
    return int(concurrency[0] if isinstance(concurrency, (tuple, list)) else concurrency)


def _check_pool_values(pool: dict) -> None:
    """SpecError for pool values map_batches would refuse later or read oddly (a string num_cpus was
    a bare TypeError here, concurrency=0 passed: trial AL)."""
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
    for key in ("num_cpus", "num_gpus", "memory"):
        if pool.get(key) is not None and not number(pool[key]):
            raise SpecError(f"pool {key} must be a number >= 0, got {pool[key]!r}")
    concurrency = pool.get("concurrency")
    sizes = list(concurrency) if isinstance(concurrency, (tuple, list)) else [concurrency]
    if concurrency is not None and not (1 <= len(sizes) <= 2 and all(isinstance(n, int) and not isinstance(n, bool)
                                                                       and n >= 1 for n in sizes) and sizes == sorted(sizes)):
        raise SpecError(f"pool concurrency must be a number of actors >= 1 or (min, max), got {concurrency!r}")
    resources = pool.get("resources")
    if resources is not None and not (isinstance(resources, dict) and all(number(v) for v in resources.values())):
        raise SpecError(f"pool resources must map names to amounts >= 0, got {resources!r}")


def _fixed(pool: dict) -> bool:
    """Whether the pool keeps its size (a fixed ActorPoolStrategy or concurrency): an autoscaling
    one may give CPUs back."""
    if (compute := pool.get("compute")) is not None:
        return getattr(compute, "min_size", None) is not None and compute.min_size == getattr(compute, "max_size", None)
    concurrency = pool.get("concurrency") or 1
    return not isinstance(concurrency, (tuple, list)) or len(set(concurrency[:2])) == 1


def _check_pool(pool: dict) -> None:
    """The pool's actors against the cluster's nodes, as ``dynatree run`` checks its own: Ray Data
    waits for ever on a pool the cluster cannot hold, saying only Ray's autoscaler's words."""
    import ray

    from dynatree.jobs import placement
    from dynatree.jobs.driver import JobError

    if not isinstance(pool, dict) or (unknown := sorted(set(pool) - _POOL - _POOL_UNCHECKED)):
        raise SpecError(f"pool takes map_batches' {', '.join(sorted(_POOL | _POOL_UNCHECKED))}, got "
                        f"{', '.join(unknown) if isinstance(pool, dict) else repr(pool)}")
    # (ray_remote_args may hold the resources; None is Ray Data's default: a CPU an actor)
    pool = {**{k: v for k, v in (pool.get("ray_remote_args") or {}).items() if k in _POOL}, **pool}
    pool["num_cpus"] = 1 if pool.get("num_cpus") is None else pool["num_cpus"]
    _check_pool_values(pool)
    if ray.is_initialized():
        nodes = ray.nodes()
    elif os.environ.get("RAY_ADDRESS"):  # (Ray Data will join a cluster this driver has not)
        warnings.warn("check(pool): RAY_ADDRESS names a cluster this process has not joined, so the pool is not "
                      "compared with it: call ray.init() before check", stacklevel=3)
        return
    else:
        nodes = [placement.local_node("this machine (no ray.init before check: Ray Data starts its cluster here)",
                                      memory=bool(pool.get("memory")))]
    memory = pool.get("memory") or None
    try:
        placement.check_request(nodes, _pool_size(pool), pool["num_cpus"], pool.get("num_gpus") or 0,
                                memory, pool.get("resources"))
    except placement.PlacementError as e:
        message = re.sub(r"--resource (\S+)=\.\.\.", r"resources={'\1': ...}", str(e))
        for flag, name in _POOL_FLAGS.items():
            message = message.replace(flag, name)
        raise JobError(f"the pool cannot be placed: {message}") from e
    cpus, taken = placement.alive_cpus(nodes), _pool_size(pool) * pool["num_cpus"]
    if cpus - taken < 1 and _fixed(pool):  # (the example's --actors 2 on 2 CPUs waited for ever: trial AL)
        raise JobError(f"the pool's {_pool_size(pool)} actor(s) take {taken:g} of the cluster's {cpus:g} CPUs for the "
                       "whole run, leaving none for Ray Data's read and write tasks (a CPU each by default): the "
                       "pipeline would wait for ever; reserve fewer CPUs (num_cpus, the pool's size) and keep the "
                       "threads option")
    if cpus - taken < 1:
        warnings.warn(f"the pool's actors take {taken:g} of the cluster's {cpus:g} CPUs, so Ray Data's read and write "
                      "tasks (a CPU each by default) may find none and the pipeline wait for ever: reserve fewer CPUs "
                      "(num_cpus, the pool's size) and keep the threads option", stacklevel=3)


def _threads(value) -> int | None:
    """The stage's ``threads`` option: None (the actor's CPUs) or a positive integer; SpecError else."""
    if value is None:
        return None
    try:
        n = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        n = None
    if n is None or n < 1:
        raise SpecError(f"threads must be a positive integer (torch threads per actor; default: the CPUs Ray "
                        f"reserved for it), got {value!r}")
    return n


def _check_device(spec: JobSpec) -> None:
    """device=cuda where the actors will find no GPU: the cluster this driver joined (ray.init
    before check), else this machine, where Ray Data starts its own."""
    import ray

    from dynatree.jobs import placement
    from dynatree.jobs.driver import JobError

    if not spec.device.startswith("cuda"):
        return
    if ray.is_initialized():
        if (no_gpu := placement.no_gpu(spec.device, ray.cluster_resources())):
            raise JobError(no_gpu)
    elif not os.environ.get("RAY_ADDRESS") and not placement.local_gpus(cuda=True):
        raise JobError(f"device {spec.device}: this machine has no CUDA GPU, and Ray Data starts its cluster here "
                       "(no ray.init(address=...) before check); use device cpu or auto")


def stage_names(message: str) -> str:
    """A job driver's message as the stage's options name things: `--chat-template` is
    chat_template, `--option kv_window=...` options kv_window=..., `--stop-token-id` stop_token_ids
    (not inside paths, nor in a shell command to run: `ray start --resources ...`, trial AL)."""
    def option(m: re.Match) -> str:
        name = m.group(1).replace("-", "_")
        name = FLAG_FIELDS.get(name, name)  # (--stop-token-id)
        return f"{name}=True" if name in _SWITCHES else name  # (a switch: --chat-template)

    def outside_commands(m: re.Match) -> str:
        if m.group(1) is not None:  # (a command in backticks: as it is)
            return m.group(1)
        text = re.sub(r"(?<![\w/.-])--option (\w+)=", r"options \1=", m.group(2))
        return re.sub(r"(?<![\w/.-])--([a-z][a-z0-9-]*)", option, text)

    return re.sub(r"(`(?:ray|dynatree|pip|python) [^`]*`)|([^`]+|`)", outside_commands, message)


class Generate:
    """Ray Data stateful batch UDF: a pyarrow batch (``batch_format="pyarrow"``) -> a pyarrow
    Table of result columns then the input's columns, ``samples`` rows per input row."""

    def __init__(self, threads: int | None = None, **options):
        """``threads``: torch threads (default: the CPUs Ray reserved for the actor -- fewer than a
        node has, so Ray Data's read and write tasks can run beside it); ``options``: JobSpec fields."""
        from .worker import ShardWorker

        spec = placed(decoding_spec(**options))
        self.spec = spec
        self.worker = ShardWorker(spec, _threads(threads) or assigned_cpus(), driver_warned=False)
        _warn_if_starving()  # (once the pair is loaded: by then Ray's view of free CPUs counts this actor)
        self.sampled = spec.method_config.temperature > 0
        self.schema = output_schema(spec.samples > 1)
        self.pool = ThreadPoolExecutor(_CALLS, thread_name_prefix="dynatree-batch")

    async def __call__(self, batch: pa.Table) -> pa.Table:
        if not isinstance(batch, pa.Table):
            raise TypeError("dynatree Generate takes pyarrow batches: map_batches(..., batch_format=\"pyarrow\") "
                            "(numpy and pandas batches turn integer ids with nulls into floats and lose column types)")
        rows, id_col = self._rows(batch)
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(self.pool, self.worker.run_shard, _STREAM, rows, _HORIZON)
        except BaseException:
            exit_if_broken(self.worker, "Ray Data")  # (a lost GPU: Ray Data starts another actor)
            raise
        return self._table(batch, results, id_col)

    def _rows(self, table: pa.Table) -> tuple[list[dict], str | None]:
        """The batch's {"id", "text"} rows for the worker, and its id column."""
        id_col = self._check(table.column_names)
        texts = py_values(table.column(self.spec.prompt_column))
        if id_col is None:  # keyed by the prompt (the rows --verify-fraction picks), not by where Ray Data put it
            ids = ["#" + hashlib.blake2b(repr(t).encode(), digest_size=8).hexdigest() for t in texts]
        else:
            ids = id_strings(table.column(id_col))
        rows = [{"id": i, "text": t} for i, t in zip(ids, texts)]
        if id_col is not None:  # a null or repeated id: that row's error (one null id failed a whole dataset)
            seen = set()
            for r in rows:
                if r["id"] is None or r["id"] in seen:
                    r["error"] = (f"id column {id_col!r}: " + ("the id is null" if r["id"] is None else
                                  f"id {r['id']} repeats an earlier row's in this batch") +
                                  " (ids key each row's seed and check: keep them unique)")
                seen.add(r["id"])
        return rows, id_col

    def _table(self, batch: pa.Table, results: list[dict], id_col: str | None) -> pa.Table:
        for r in results:  # (a row's error as the stage's options name things, not a job's flags)
            if r.get("error"):
                r["error"] = stage_names(r["error"])
        out = pa.Table.from_pylist(results, schema=self.schema)
        if id_col is None:  # the engine's ids were the prompts' hashes: none to show
            out = out.set_column(self.schema.get_field_index("id"), "id", pa.nulls(len(results), pa.string()))
        carried = each_repeated(batch, self.spec.samples)
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
        taken = set(self.schema.names) - ({"id"} if id_col == "id" else set())  # (an id column is the result's id)
        clash = [c for c in names if c in taken]
        if clash:
            raise ValueError(f"dynatree: input column(s) {', '.join(clash)} would be overwritten by result columns "
                             "of the same name; rename or drop them first (ds.rename_columns / drop_columns)")
        if id_col is None and self.sampled:  # (equal prompts would draw equal samples)
            raise ValueError("dynatree: sampling needs an id column (option id_column, or a column named id): a "
                             "row's seed comes from its id, so that it does not depend on how Ray Data batches rows")
        return id_col


def _warn_if_starving() -> None:
    """Say so where Ray Data's own tasks (listing, reading, writing files: a CPU each by default)
    may find no CPU beside the actors: the pipeline then waits for ever without a message."""
    import ray

    if not ray.is_initialized():
        return
    ctx = ray.get_runtime_context()
    mine = ctx.get_assigned_resources().get("CPU", 0)
    node = next((n for n in ray.nodes() if n.get("NodeID") == ctx.get_node_id()), {})
    total = node.get("Resources", {}).get("CPU", 0)
    # (the definite case first: on a cluster of small nodes an actor also fills its own, and the
    # same "may" was said for a pipeline that ran and one that hung: the two-node trial)
    if ray.available_resources().get("CPU", 0) < 1:  # (the actors placed so far hold the rest)
        why = ("the cluster has less than one CPU left now that this actor is placed, so Ray Data's read and write "
               "tasks cannot run beside the actors: the pipeline waits until CPUs free up -- for ever if this "
               "pipeline's own actors hold them, until they end if other jobs' do")
    elif mine and mine >= total:
        why = (f"this actor reserved all {total:g} CPUs of its node, so Ray Data's read and write tasks may not run "
               "beside the actors (the pipeline then waits for ever)")
    else:
        return
    print(f"dynatree Generate: WARNING {why}: reserve fewer CPUs (map_batches num_cpus, ActorPoolStrategy size) "
          "and keep the threads (Generate's threads option)", file=sys.stderr, flush=True)
