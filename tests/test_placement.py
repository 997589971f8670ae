"""Actor placement: impossible requests fail at once, unavailable ones after a deadline, and a
failing actor constructor surfaces its own message -- nothing waits silently."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from dynatree.jobs.driver import start_local_ray
from dynatree.jobs.placement import (PlacementError, actor_options, check_request, describe_error,
                                     feasible_actors, release, reserve, wait_ready)

GB = 1e9


def node(ip, cpu=0, gpu=0, mem=16 * GB, alive=True):
    res = {"CPU": cpu, "memory": mem, f"node:{ip}": 1.0}
    if gpu:
        res["GPU"] = gpu
    return {"NodeManagerAddress": ip, "Alive": alive, "Resources": res}


TWO_NODES = [node("10.0.0.1", cpu=8, gpu=2), node("10.0.0.2", cpu=4)]


# ---------------------------------------------------------------- pure


def test_feasible_sums_whole_actors_per_node():
    assert feasible_actors(TWO_NODES, 2, 0) == 4 + 2
    assert feasible_actors(TWO_NODES, 3, 0) == 2 + 1  # 1 CPU left on each node is no actor
    assert feasible_actors(TWO_NODES, 1, 1) == 2  # only the first node has GPUs
    assert feasible_actors(TWO_NODES, 4, 1) == 2
    assert feasible_actors(TWO_NODES, 5, 1) == 1
    assert feasible_actors(TWO_NODES, 1, 0.5) == 4
    assert feasible_actors(TWO_NODES, 16, 0) == 0  # an actor cannot span nodes


def test_feasible_fractional_cpus_and_memory():
    nodes = [node("a", cpu=2)]
    assert feasible_actors(nodes, 0.1, 0) == 20  # not 19 from 2 / 0.1 = 19.999...
    assert feasible_actors(nodes, 0.3, 0) == 6
    assert feasible_actors(nodes, 0.5, 0, memory=6 * GB) == 2  # memory binds before CPU
    assert feasible_actors(nodes, 0.5, 0, memory=0) == 4  # zero means "no constraint"


def test_feasible_skips_dead_nodes():
    nodes = [node("a", cpu=4), node("b", cpu=64, alive=False)]
    assert feasible_actors(nodes, 1, 0) == 4


def test_check_request_counts_when_n_is_none():
    assert check_request(TWO_NODES, None, 2, 0) == 6
    assert check_request(TWO_NODES, None, 1, 1) == 2
    assert check_request(TWO_NODES, 3, 2, 0) == 3


def test_check_request_too_many_names_request_cluster_and_flag():
    with pytest.raises(PlacementError) as e:
        check_request([node("127.0.0.1", cpu=2, mem=20.1 * GB)], 3, 1, 0)
    msg = str(e.value)
    assert "3 actor(s) × {CPU: 1, GPU: 0}" in msg
    assert "at most 2" in msg
    assert "node 127.0.0.1: 2 CPU, 0 GPU, 20.1 GB memory" in msg
    assert "--num-actors to at most 2" in msg and "--cpus-per-actor" in msg


def test_nodes_on_one_machine_are_told_apart():
    """Two nodes on one machine were both "node 192.0.2.2" in a refusal (the two-node trial)."""
    a, b = node("192.0.2.2", cpu=1), node("192.0.2.2", cpu=1)
    a["NodeID"], b["NodeID"] = "65a3da68" + "0" * 48, "a0132f06" + "0" * 48
    with pytest.raises(PlacementError, match=r"node 192.0.2.2 \(65a3da68\): 1 CPU.*node 192.0.2.2 \(a0132f06\): 1 CPU"):
        check_request([a, b], 1, 2, 0)


def test_check_request_shape_too_big_for_any_node_names_that_resource():
    with pytest.raises(PlacementError, match=r"nodes hold at most 0.*lower --gpus-per-actor$"):
        check_request([node("a", cpu=8)], None, 1, 1)  # GPUs on a CPU-only cluster
    with pytest.raises(PlacementError, match=r"even 1 actor.*lower --cpus-per-actor$"):
        check_request(TWO_NODES, None, 9, 0)
    with pytest.raises(PlacementError, match=r"lower --memory-per-actor$"):
        check_request(TWO_NODES, 1, 1, 0, memory=32 * GB)
    # enough of each somewhere, never together: both are candidates
    with pytest.raises(PlacementError, match=r"--cpus-per-actor / --gpus-per-actor$"):
        check_request([node("a", cpu=8), node("b", cpu=2, gpu=2)], 1, 4, 1)


def test_check_request_no_alive_nodes():
    with pytest.raises(PlacementError, match="no alive nodes"):
        check_request([node("a", cpu=4, alive=False)], 1, 1, 0)


# ---------------------------------------------------------------- a real 2-CPU local cluster


@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("a Ray session is already open in this process")
    start_local_ray(num_cpus=2, resources={"fast": 1}, log_to_driver=False)  # (a custom resource: --resource)

    # defined here so cloudpickle ships them by value (workers cannot import this test module)
    class Unpicklable(Exception):
        def __init__(self, msg):
            super().__init__(msg)
            self.fn = lambda: None  # plain pickle refuses lambdas

    @ray.remote
    class Probe:
        def __init__(self, fail=None, ready_delay=0.0):
            if fail == "value":
                raise ValueError("no such file: /nope")
            if fail == "unpicklable":
                raise Unpicklable("cannot load model '/x': bad header")
            self.ready_delay = ready_delay

        def ready(self):
            time.sleep(self.ready_delay)
            return {"ok": True}

        def boom(self):
            raise KeyError("missing column 'text'")

    try:
        yield SimpleNamespace(ray=ray, Probe=Probe)
    finally:
        ray.shutdown()


@pytest.mark.parametrize("n,cpus", [(3, 1), (2, 2), (1, 4)])
def test_oversized_requests_fail_at_once(cluster, n, cpus):
    t = time.monotonic()
    with pytest.raises(PlacementError) as e:
        check_request(cluster.ray.nodes(), n, cpus, 0)
    assert time.monotonic() - t < 2
    assert f"{n} actor(s) × {{CPU: {cpus}, GPU: 0}}" in str(e.value)
    assert "2 CPU" in str(e.value)


def test_gpus_on_cpu_only_cluster_fail_at_once(cluster):
    with pytest.raises(PlacementError, match="--gpus-per-actor"):
        check_request(cluster.ray.nodes(), None, 1, 1)


def test_reserve_of_unavailable_resources_times_out_with_message(cluster):
    ray = cluster.ray
    held = reserve(2, 1, 0, timeout_s=20)
    logged = []
    try:
        t = time.monotonic()
        with pytest.raises(PlacementError) as e:
            reserve(1, 1, 0, timeout_s=3, log=logged.append)
        took = time.monotonic() - t
    finally:
        release(held)
    assert 2.5 < took < 10
    msg = str(e.value)
    assert "1 actor(s) × {CPU: 1, GPU: 0} within 3 s" in msg
    assert "other jobs or actors may hold" in msg
    assert "available: 0 CPU" in msg and "total: 2 CPU" in msg
    assert msg.endswith("free them, wait longer (--placement-timeout-s) or lower --cpus-per-actor")  # (1 actor:
    assert logged and "waiting up to 3 s" in logged[0]  # "lower --num-actors" said nothing to do: the two-node trial)
    # the timed-out group was removed and the released one freed: everything is back
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU", 0) == 2


def test_default_actor_count_leaves_what_other_jobs_hold(cluster):
    """The default --num-actors counts the free resources: a reservation of every CPU the nodes hold
    while another job holds one would wait out its deadline, then fail (the s51 left-over)."""
    from dynatree.jobs.driver import _Dispatch

    logged = []
    job = SimpleNamespace(spec=SimpleNamespace(resources_per_actor=None), cpus=1.0, gpus=0.0, memory=None,
                          log=logged.append)
    assert _Dispatch._free_share(job, cluster.ray, 2) == 2 and not logged
    held = reserve(1, 1, 0, timeout_s=20)
    try:
        time.sleep(0.5)  # (available_resources trails the reservation a little)
        assert _Dispatch._free_share(job, cluster.ray, 2) == 1
    finally:
        release(held)
    assert "starting 1 of the 2 actor(s) the cluster holds at this shape" in logged[0]
    assert "(1 CPU free now; --num-actors 2 waits for them" in logged[0]


def test_a_custom_resource_places_actors_only_where_a_node_offers_it(cluster):
    """dynatree run --resource KEY=N (Ray's custom resources, `ray start --resources`): counted per
    node, reserved with the bundle, asked by the actor; one no node offers is named as such."""
    ray, Probe = cluster.ray, cluster.Probe
    nodes = ray.nodes()
    assert check_request(nodes, None, 1, 0, custom={"fast": 1}) == 1  # (the CPUs hold 2; the resource 1)
    with pytest.raises(PlacementError, match=r"2 actor\(s\) × \{CPU: 1, GPU: 0, fast: 1\}: the cluster's nodes hold "
                                             r"at most 1 \(node .*: 2 CPU, 0 GPU, .*1 fast\); lower --num-actors to at "
                                             r"most 1 or lower --resource fast=\.\.\.$"):
        check_request(nodes, 2, 1, 0, custom={"fast": 1})
    with pytest.raises(PlacementError, match=r"no node offers fsat: a node does when started with `ray start "
                                             r"--resources '\{\"fsat\": N\}'`"):
        check_request(nodes, 1, 1, 0, custom={"fsat": 1})
    pg = reserve(1, 1, 0, custom={"fast": 1}, timeout_s=20)
    actor = None
    try:
        actor = Probe.options(**actor_options(pg, 0, 1, 0, custom={"fast": 1}), max_restarts=0).remote()
        assert wait_ready([actor.ready.remote()], timeout_s=30) == [{"ok": True}]
        assert ray.available_resources().get("fast", 0) == 0  # (held by the group)
        with pytest.raises(PlacementError, match=r"could not reserve 1 actor\(s\) × \{CPU: 1, GPU: 0, fast: 1\} "
                                                 r"within 2 s: .*\(available: 1 CPU, 0 GPU, .*0 fast; total: 2 CPU, 0 "
                                                 r"GPU, .*1 fast\)"):
            reserve(1, 1, 0, custom={"fast": 1}, timeout_s=2, log=lambda m: None)
    finally:
        if actor is not None:
            ray.kill(actor)
        release(pg)


def test_actor_in_bundle_starts_and_replacement_reuses_bundle(cluster):
    ray, Probe = cluster.ray, cluster.Probe
    pg = reserve(2, 1, 0, timeout_s=20)
    actors = []
    try:
        actors = [Probe.options(**actor_options(pg, i, 1, 0), max_restarts=0).remote()
                  for i in range(2)]
        assert wait_ready([a.ready.remote() for a in actors], timeout_s=30) == [{"ok": True}] * 2
        # with the group full, a replacement only starts in the bundle its predecessor freed
        ray.kill(actors[1])
        actors[1] = Probe.options(**actor_options(pg, 1, 1, 0), max_restarts=0).remote()
        assert wait_ready([actors[1].ready.remote()], timeout_s=30) == [{"ok": True}]
        with pytest.raises(ray.exceptions.RayTaskError) as e:
            ray.get(actors[0].boom.remote())
        assert describe_error(e.value) == "KeyError: \"missing column 'text'\""
    finally:
        for a in actors:
            ray.kill(a)
        release(pg)


def test_failing_constructor_reports_its_own_message_once(cluster):
    ray, Probe = cluster.ray, cluster.Probe
    pg = reserve(2, 1, 0, timeout_s=20)
    actors = [Probe.options(**actor_options(pg, 0, 1, 0), max_restarts=0).remote(),
              Probe.options(**actor_options(pg, 1, 1, 0), max_restarts=0).remote(fail="value")]
    try:
        with pytest.raises(PlacementError) as e:
            wait_ready([a.ready.remote() for a in actors], timeout_s=30, what="model actor")
    finally:
        for a in actors:
            ray.kill(a)
        release(pg)
    msg = str(e.value)
    assert msg == "model actor 2 of 2 failed to start: ValueError: no such file: /nope"
    assert "Traceback" not in msg and msg.count("no such file") == 1
    cause = e.value.__cause__  # the full Ray error stays reachable for debugging
    assert isinstance(cause, ray.exceptions.RayActorError) and cause.actor_init_failed


def test_unpicklable_constructor_error_still_gives_its_message(cluster):
    ray, Probe = cluster.ray, cluster.Probe
    a = Probe.options(num_cpus=1, max_restarts=0).remote(fail="unpicklable")
    try:
        with pytest.raises(PlacementError) as e:
            wait_ready([a.ready.remote()], timeout_s=30)
    finally:
        ray.kill(a)
    assert str(e.value).endswith("Unpicklable: cannot load model '/x': bad header")
    assert "\n" not in str(e.value)


def test_wait_ready_deadline_fires(cluster):
    ray, Probe = cluster.ray, cluster.Probe
    a = Probe.options(num_cpus=1, max_restarts=0).remote(ready_delay=30)
    try:
        t = time.monotonic()
        with pytest.raises(PlacementError, match=r"^1 of 1 actor\(s\) not ready after 2 s"):
            wait_ready([a.ready.remote()], timeout_s=2)
        assert time.monotonic() - t < 6
    finally:
        ray.kill(a)


def test_placement_exact_fits_and_fixed_point_quantities():
    """n actors that exactly fill the cluster are placed (not refused), and quantities are Ray's
    1e-4 fixed point rounded, not truncated (0.57 * 1e4 is 5699.99... in binary floating point)."""
    nodes = [{"NodeManagerAddress": "a", "Alive": True, "Resources": {"CPU": 8, "GPU": 2}},
             {"NodeManagerAddress": "b", "Alive": True, "Resources": {"CPU": 4}}]
    assert check_request(nodes, 6, 2, 0) == 6 and check_request(nodes, None, 2, 0) == 6
    assert check_request(nodes, 2, 1, 1) == 2
    assert feasible_actors([{"Resources": {"CPU": 0.57}}], 0.01, 0) == 57
