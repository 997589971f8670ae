"""The Ray actor: a thin shell around ShardWorker (the pair is loaded once, in __init__).

The worker module (torch, transformers, the engine) is imported inside the actor process only,
so the driver that defines and starts actors stays light.  Started with ``max_concurrency`` > 1
(driver): each in-flight ``run_shard`` call waits on its own thread while the worker's one
decoding thread serves all of them in shared batches."""
from __future__ import annotations

import dataclasses
import os
import sys

import ray


def placed(spec):
    """``spec`` for this Ray worker: device auto without a GPU reserved is the CPU, even where CUDA
    devices are visible (Ray need not hide them from an actor that asked for none)."""
    if spec.device == "auto" and ray.is_initialized() and not ray.get_gpu_ids():
        return dataclasses.replace(spec, device="cpu")
    return spec


def assigned_cpus() -> int | None:
    """The CPUs Ray reserved for this worker (its torch threads), or None outside Ray."""
    if not ray.is_initialized():
        return None
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    return max(1, int(cpus)) if cpus else None


def exit_if_broken(worker, replacer: str) -> None:
    """End this process where the worker's decoding thread died (a lost GPU): it can decode nothing
    more, and a dead actor is what ``replacer`` (the job's driver, Ray Data) starts another for."""
    broken = worker.scheduler.broken
    if broken is not None:
        print(f"dynatree actor: decoding thread died ({broken!r}); exiting so {replacer} replaces this actor",
              file=sys.stderr, flush=True)
        os._exit(1)


def _node() -> dict:
    """The Ray node this actor runs on (summary.json: how a job spread over a cluster)."""
    return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address()}


@ray.remote
class PairActor:
    """One per GPU on a GPU box; a CPU share (``cpus_per_actor`` threads) on CPU machines."""

    def __init__(self, spec, threads: int | None = None, share: float | None = None):
        from .worker import ShardWorker

        spec = placed(spec)
        self.failed: Exception | None = None
        try:
            self.worker = ShardWorker(spec, threads, share)
        except Exception as e:  # noqa: BLE001 -- said by ready(), the driver's readiness call
            # (raised here, Ray prints the whole creation traceback in the driver's terminal
            # before the job's one-line error; the driver removes the actor with its bundle)
            self.failed = e

    def ready(self) -> dict:
        if self.failed is not None:
            raise self.failed
        return {**self.worker.ready(), **_node()}

    def stats(self) -> dict:
        if self.failed is not None:
            raise self.failed
        return {**self.worker.stats(), **_node()}

    def run_shard(self, shard: str, rows: list[dict], backlog: int = 0) -> list[dict]:
        if self.failed is not None:  # a replacement that failed to start: said as such, not as a death
            from dynatree.jobs.placement import StartFailed  # (whose race with ready()'s reply lost the cause)

            raise StartFailed(f"{type(self.failed).__name__}: {self.failed}")
        try:
            return self.worker.run_shard(shard, rows, backlog)
        except BaseException:
            exit_if_broken(self.worker, "the job")  # (the driver starts another in its bundle)
            raise
