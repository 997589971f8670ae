"""The Ray actor: a thin shell around ShardWorker (the pair is loaded once, in __init__).

Started with ``max_concurrency`` > 1 (driver): each in-flight ``run_shard`` call waits on its
own thread while the worker's one decoding thread serves all of them in shared batches."""
from __future__ import annotations

import ray

from .worker import ShardWorker


@ray.remote
class PairActor(ShardWorker):
    """One per GPU on a GPU box; a CPU share (``cpus_per_actor`` threads) on CPU machines."""
