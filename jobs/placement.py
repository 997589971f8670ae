"""Reserve cluster resources for the job's actors up front, and fail loudly when they cannot fit.

Starting actors whose resources the cluster cannot provide makes ``ray.get(actor.ready.remote())``
wait forever without a word.  Here the request is checked against the nodes' totals first (an
impossible shape fails at once), then reserved as a placement group with a deadline (a shape that
fits but is held by someone else fails after ``timeout_s``), and actors are placed into its
bundles so a replacement for a dead actor lands in the resources its predecessor freed.
"""
from __future__ import annotations

import os
import re
import time

RESOURCE_UNIT = 1e-4  # Ray stores resource quantities as fixed point at this resolution (a smaller one reads as 0)
_UNIT = round(1 / RESOURCE_UNIT)
_FLAGS = {"CPU": "--cpus-per-actor", "GPU": "--gpus-per-actor", "memory": "--memory-per-actor"}


class PlacementError(RuntimeError):
    """The requested actors cannot be placed or did not start."""


class StartFailed(RuntimeError):
    """A shard sent to an actor that failed to load (its message: the load's error): the driver
    starts another in its place, and charges no attempt to the shard."""


def _shape(cpus: float, gpus: float, memory: float | None = None, custom: dict | None = None) -> dict[str, float]:
    shape = {"CPU": float(cpus), "GPU": float(gpus)}
    if memory:
        shape["memory"] = float(memory)
    shape.update({k: float(v) for k, v in (custom or {}).items()})  # (--resource: `ray start --resources`)
    return shape


def _flag(resource: str) -> str:
    return _FLAGS.get(resource, f"--resource {resource}=...")


def _wanted(shape: dict[str, float]) -> dict[str, float]:
    # zero-valued resources constrain nothing, and Ray rejects them inside bundles
    wanted = {k: v for k, v in shape.items() if v > 0}
    if not wanted:
        raise PlacementError(f"an actor must ask for some CPU or GPU, got {_fmt_shape(shape)}")
    return wanted


def _alive(nodes: list[dict]) -> list[dict]:
    return [n for n in nodes if n.get("Alive", n.get("alive", True))]


def alive_cpus(nodes: list[dict]) -> float:
    return sum(n.get("Resources", {}).get("CPU", 0) for n in _alive(nodes))


def _node_fits(resources: dict, wanted: dict[str, float]) -> int:
    return min(round(resources.get(k, 0) * _UNIT) // round(v * _UNIT) for k, v in wanted.items())


def feasible_actors(nodes: list[dict], cpus: float, gpus: float, memory: float | None = None,
                    custom: dict | None = None) -> int:
    """How many actors of this shape fit in the alive nodes' total resources (an actor cannot
    span nodes, so each node contributes its own whole number)."""
    wanted = _wanted(_shape(cpus, gpus, memory, custom))
    return sum(_node_fits(n.get("Resources", {}), wanted) for n in _alive(nodes))


def free_actors(available: dict, n: int, cpus: float, gpus: float, memory: float | None = None,
                custom: dict | None = None) -> int:
    """Of ``n`` actors the nodes hold, how many the resources free now hold (counted cluster-wide,
    so at most that many; at least 1: it waits for the resources, with a deadline)."""
    return max(1, min(n, _node_fits(available, _wanted(_shape(cpus, gpus, memory, custom)))))


def fmt_free(available: dict, cpus: float, gpus: float, memory: float | None = None,
             custom: dict | None = None) -> str:
    """What is free of the resources an actor of this shape asks for."""
    wanted = _wanted(_shape(cpus, gpus, memory, custom))
    return ", ".join(f"{_fmt_mem(available.get(k, 0)) if k == 'memory' else _fmt_num(available.get(k, 0))} {k}"
                     for k in wanted)


def _fmt_num(x: float) -> str:
    return f"{x:g}"


def _fmt_shape(shape: dict[str, float]) -> str:
    parts = [f"{k}: {_fmt_mem(v) if k == 'memory' else _fmt_num(v)}" for k, v in shape.items()]
    return "{" + ", ".join(parts) + "}"


def _fmt_mem(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB"


def _fmt_resources(res: dict, custom=()) -> str:
    memory = f", {_fmt_mem(res['memory'])} memory" if "memory" in res else ""  # (this machine before Ray starts)
    asked = "".join(f", {_fmt_num(res.get(k, 0))} {k}" for k in custom)  # (the custom ones asked for)
    return f"{_fmt_num(res.get('CPU', 0))} CPU, {_fmt_num(res.get('GPU', 0))} GPU{memory}{asked}"


def _fmt_nodes(nodes: list[dict], limit: int = 4, custom=()) -> str:
    alive = _alive(nodes)
    if not alive:
        return "no alive nodes"
    addresses = [n.get("NodeManagerAddress", "?") for n in alive]
    # (nodes that share an address -- several on one machine -- told apart by their ids' first digits)
    named = [a if addresses.count(a) == 1 else f"{a} ({str(n.get('NodeID', '?'))[:8]})" for a, n in zip(addresses, alive)]
    parts = [f"node {a}: {_fmt_resources(n.get('Resources', {}), custom)}" for a, n in zip(named[:limit], alive[:limit])]
    if len(alive) > limit:
        parts.append(f"and {len(alive) - limit} more")
    return "; ".join(parts)


def _binding(nodes: list[dict], wanted: dict[str, float], fits: int) -> list[str]:
    """The wanted resources that hold the count down: without one of them, more actors would fit."""
    def count(shape):
        return sum(_node_fits(n.get("Resources", {}), shape) for n in _alive(nodes)) if shape else 1 << 30

    return [k for k in wanted if count({j: v for j, v in wanted.items() if j != k}) > fits]


def _hint(nodes: list[dict], wanted: dict[str, float], fits: int) -> str:
    """What to change: the flags of the resources that bind (lowering --cpus-per-actor could not help
    an actor short of a custom resource: the resource trial)."""
    binding = _binding(nodes, wanted, fits) or list(wanted)
    if fits > 0:
        return f"lower --num-actors to at most {fits} or lower " + " / ".join(_flag(k) for k in binding)
    short = [k for k, v in wanted.items()
             if not any(n.get("Resources", {}).get(k, 0) >= v for n in _alive(nodes))]
    absent = [k for k in short if k not in _FLAGS and not any(k in n.get("Resources", {}) for n in _alive(nodes))]
    if absent:  # (a custom resource no node was started with: a typo, or nodes started without it)
        return (f"no node offers {', '.join(absent)}: a node does when started with `ray start --resources "
                f"'{{\"{absent[0]}\": N}}'`")
    if not short and len(binding) > 1:  # each is somewhere, never together
        return f"no single node offers {' and '.join(binding)} together: lower " + " / ".join(map(_flag, binding))
    return "lower " + " / ".join(_flag(k) for k in (short or binding))


def check_request(nodes: list[dict], n: int | None, cpus: float, gpus: float,
                  memory: float | None = None, custom: dict | None = None) -> int:
    """The number of actors to start: ``n`` if it fits, else as many as fit when ``n`` is None.
    Raises PlacementError naming the request, the cluster and the flag to change."""
    shape = _shape(cpus, gpus, memory, custom)
    fits = feasible_actors(nodes, cpus, gpus, memory, custom)
    want = 1 if n is None else n
    if want <= fits:
        return fits if n is None else n
    asked = "even 1 actor" if n is None else f"{n} actor(s)"
    raise PlacementError(
        f"cannot place {asked} × {_fmt_shape(shape)}: the cluster's nodes hold at most {fits} "
        f"({_fmt_nodes(nodes, custom=list(custom or ()))}); {_hint(nodes, _wanted(shape), fits)}")


def _core(res: dict, custom=()) -> dict:
    # placement groups add per-group resources (CPU_group_<id>, bundle_group_...) that mean
    # nothing to the user
    return {k: res.get(k, 0) for k in ("CPU", "GPU", "memory", *custom)}


def reserve(n: int, cpus: float, gpus: float, *, memory: float | None = None, custom: dict | None = None,
            timeout_s: float = 60.0, log=print):
    """Reserve ``n`` bundles of the actor shape as a PACK placement group; returns the group.

    Raises PlacementError (after removing the group) if it is not ready within ``timeout_s``."""
    import ray
    from ray.util.placement_group import placement_group

    shape = _shape(cpus, gpus, memory, custom)
    extra = list(custom or ())
    pg = placement_group([_wanted(shape)] * n, strategy="PACK")
    ready = pg.ready()
    t0 = time.monotonic()
    done, _ = ray.wait([ready], timeout=min(5.0, timeout_s))
    if not done:  # say why we are waiting rather than sit silent
        log(f"waiting up to {timeout_s:g} s for {n} × {_fmt_shape(shape)} "
            f"(available now: {_fmt_resources(_core(ray.available_resources(), extra), extra)})")
        done, _ = ray.wait([ready], timeout=max(0.0, timeout_s - (time.monotonic() - t0)))
    if done:
        return pg
    release(pg)
    total, avail = _core(ray.cluster_resources(), extra), _core(ray.available_resources(), extra)
    fits = feasible_actors(ray.nodes(), cpus, gpus, memory, custom)
    why = ("the cluster could hold them, so other jobs or actors may hold the resources now"
           if fits >= n else f"the cluster's nodes hold at most {fits}")
    raise PlacementError(
        f"could not reserve {n} actor(s) × {_fmt_shape(shape)} within {timeout_s:g} s: {why} "
        f"(available: {_fmt_resources(avail, extra)}; total: {_fmt_resources(total, extra)}); "
        f"free them, wait longer (--placement-timeout-s) or lower {'--num-actors / ' if n > 1 else ''}"
        + " / ".join(_flag(k) for k in ([k for k, v in _wanted(shape).items() if avail.get(k, 0) < n * v]
                                         or ["CPU"])))


def actor_options(pg, index: int, cpus: float, gpus: float, memory: float | None = None,
                  custom: dict | None = None) -> dict:
    """``.options(...)`` kwargs that start an actor inside bundle ``index`` of ``pg``; a
    replacement for a dead actor given the same index takes the resources it freed."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    opts = {"num_cpus": cpus, "num_gpus": gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=index)}
    if memory:
        opts["memory"] = memory
    if custom:
        opts["resources"] = dict(custom)
    return opts


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _clip(text: str, lines: int = 2, width: int = 300) -> str:
    kept = [ln.strip() for ln in _ANSI.sub("", text).splitlines() if ln.strip()][:lines]
    return "\n".join(ln if len(ln) <= width else ln[:width - 1] + "…" for ln in kept)


def _task_error(err: BaseException):
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(err, RayTaskError):
        return err
    # an ActorDiedError built from a failed __init__ keeps that RayTaskError as its only arg
    # (it is not stored under an attribute; pickling re-runs __init__ with it)
    if isinstance(err, RayActorError) and err.args and isinstance(err.args[0], RayTaskError):
        return err.args[0]
    return None


def task_cause(err: BaseException) -> BaseException | None:
    """The exception a remote call raised (through calls it made itself), or None for a death."""
    from ray.exceptions import RayTaskError

    cause = getattr(_task_error(err), "cause", None)
    while isinstance(cause, RayTaskError):
        cause = cause.cause
    return cause


def node_died(err: BaseException) -> bool:
    """Whether an actor died with its node (a lost machine, a preempted one), not by its own doing:
    Ray's error says so in words (the GCS writes them) or marks a drain's preemption."""
    return bool(getattr(err, "preempted", False)) or "its node has died" in str(err)


def describe_error(err: BaseException) -> str:
    """The root cause of a remote failure in one or two lines, e.g. ``ValueError: no such file``,
    instead of Ray's message (which embeds the remote traceback)."""
    from ray.exceptions import RayError

    task_err = _task_error(err)
    if task_err is None:
        lines = str(err).splitlines()
        if getattr(err, "actor_init_failed", False) and lines:
            return _clip(lines[-1])  # the traceback's last line is the exception itself
        # system deaths: first line says what, the next un-indented one says why
        return _clip("\n".join(ln for ln in lines if not ln.startswith("\t")))
    cause = task_cause(err)  # (through remote calls made from inside the remote code)
    if cause is None or type(cause) is RayError:
        # the original exception could not be pickled; Ray's stand-in text ends with its
        # traceback, whose last line is the original "Type: message"
        text = str(cause if cause is not None else task_err).rstrip().splitlines()
        return _clip(text[-1] if text else repr(err))
    msg = str(cause)
    return _clip(f"{type(cause).__name__}: {msg}" if msg else type(cause).__name__)


def wait_ready(refs: list, *, timeout_s: float, what: str = "actor") -> list:
    """Results of ``refs`` (``actor.ready.remote()`` calls) in order, waiting at most
    ``timeout_s``.  The first failure raises PlacementError with its root cause; the deadline
    raises PlacementError saying how many are still not ready."""
    import ray
    from ray.exceptions import RayError

    deadline = time.monotonic() + timeout_s
    where = {ref: i for i, ref in enumerate(refs)}
    results: list = [None] * len(refs)
    pending = list(refs)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in done:
            try:
                results[where[ref]] = ray.get(ref)
            except RayError as err:
                again = " (a node lost while loading: the same command starts on the nodes left)" if node_died(err) else ""
                raise PlacementError(f"{what} {where[ref] + 1} of {len(refs)} failed to start: "
                                     f"{describe_error(err)}{again}") from err
    if pending:
        raise PlacementError(
            f"{len(pending)} of {len(refs)} {what}(s) not ready after {timeout_s:g} s: their resources are "
            f"reserved, so loading the models (and a first kernel build) takes longer than that -- raise "
            f"--ready-timeout-s")
    return results


def release(pg) -> None:
    """Remove the placement group (no-op for None or after ray.shutdown())."""
    import ray
    from ray.util.placement_group import remove_placement_group

    if pg is not None and ray.is_initialized():
        remove_placement_group(pg)


def local_gpus(cuda: bool = False) -> int:
    """The GPUs a local Ray cluster will hold, counted as Ray counts them (capped by the visible
    devices; ray._private.resource_and_label_spec), not by importing torch (1.1 s and ~180 MB of
    the driver's memory).  ``cuda``: only those torch's "cuda" device runs on (NVIDIA's, AMD's
    ROCm), where Ray's GPU resource may be another kind (Apple's, Intel's)."""
    try:
        from ray._private import accelerators  # (private: may move)
    except ImportError:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    kinds = ([accelerators.NvidiaGPUAcceleratorManager, accelerators.AMDGPUAcceleratorManager] if cuda
             else [accelerators.get_accelerator_manager_for_resource("GPU")])
    count = 0
    for gpu in kinds:
        n, visible = gpu.get_current_node_num_accelerators(), gpu.get_current_process_visible_accelerator_ids()
        count += n if visible is None else min(n, len(visible))
    return count


def local_node(name: str, memory: bool = False) -> dict:
    """This machine as ray.nodes() would show the local cluster Ray starts here (cgroup CPU quotas
    included), before it starts: its CPUs, GPUs and, if ``memory``, its memory."""
    try:
        from ray._private.utils import get_num_cpus
    except ImportError:  # (a private helper: another Ray version may move it)
        def get_num_cpus():
            return os.cpu_count() or 1
    here = {"CPU": get_num_cpus(), "GPU": local_gpus()}
    if memory:
        here["memory"] = local_memory()
    return {"NodeManagerAddress": name, "Resources": here}


def _ray_memory() -> tuple[float, float] | None:
    """(available memory, its default object store) as a local Ray cluster started now computes
    them, or None where Ray's private helpers cannot say."""
    try:
        from ray._private import utils  # (private: may move)

        available = utils.estimate_available_memory()
        return float(available), float(utils.resolve_object_store_memory(available))
    except (ImportError, AttributeError, TypeError):
        return None


def local_store() -> float | None:
    """The object store Ray gives a local cluster it starts here by default (None: unknown)."""
    got = _ray_memory()
    return None if got is None else got[1]


def local_memory() -> float:
    """The ``memory`` resource a local Ray cluster started now offers, as Ray computes it (the
    available memory less its object store's share: 15.8 of 25.3 GB on a 24 GiB machine); the
    machine's whole memory had passed a 20 GB request that Ray then could not place."""
    got = _ray_memory()
    if got is None:
        import psutil  # (Ray's copy)

        return float(psutil.virtual_memory().total)
    return got[0] - got[1]


def no_gpu(device: str, resources: dict) -> str | None:
    """Why a ``cuda`` device cannot run on a cluster with these resources (None: it can)."""
    if device.startswith("cuda") and resources.get("GPU", 0) <= 0:
        return (f"--device {device}: the Ray cluster has no GPUs (resources: {resources.get('CPU', 0):g} CPU); "
                "use --device cpu or auto")
    return None
