"""The cluster path: cluster.yaml validates, and `ray job submit` runs a job on a loopback head
started by hand with token authentication (only the processes this test starts are stopped)."""
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_cluster_yaml_is_a_valid_ray_up_config():
    from ray.autoscaler._private.util import prepare_config, validate_config
    cfg = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    validate_config(prepare_config(cfg))  # what `ray up` does before touching any node
    assert cfg["provider"]["type"] == "local"
    assert any("RAY_AUTH_MODE=token" in c for c in cfg["head_start_ray_commands"])
    assert any("--dashboard-host=127.0.0.1" in c for c in cfg["head_start_ray_commands"])
    # the README's `ray job submit -- dynatree run` runs with the PATH Ray was started with: the venv on it
    # (the Ray Data trial: "dynatree: not found", exit 127, with the venv's ray called by its path alone)
    starts = [c for k in ("head_start_ray_commands", "worker_start_ray_commands") for c in cfg[k] if "ray start" in c]
    assert len(starts) == 2 and all(c.startswith("export PATH=~/dynatree-venv/bin:$PATH && ") for c in starts)
    prepared = prepare_config(cfg)  # the checkout is mounted without what git ignores (.venv: GBs)
    assert ".gitignore" in prepared["rsync_filter"] and ".venv" in prepared["rsync_exclude"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def ray_head(env: dict, *flags: str):
    """A loopback Ray head with 2 CPUs started by hand for one test, stopped (only it) after.
    Its own short temp dir (Ray's Unix sockets live under it) keeps it from registering as the
    machine's "current cluster" for later ray.init() calls."""
    temp_dir = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    head = subprocess.Popen(
        [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
         f"--temp-dir={temp_dir}", "--num-cpus=2", "--disable-usage-stats", *flags],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        yield temp_dir
    finally:
        # SIGTERM to `ray start --block` alone: it stops its processes in order in ~4 s, while a
        # SIGTERM to the whole group left the raylet and GCS to linger ~35 s.
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(head.pid, signal.SIGKILL)  # whatever of its group outlived it
        except ProcessLookupError:
            pass
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_ray_job_submit_on_loopback_with_token_auth(pair_dirs, tmp_path):
    bindir = Path(sys.executable).parent
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
           "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("RAY_ADDRESS", None)
    gcs, dash = free_port(), free_port()
    # (its agents on ports of their own: one on Ray's default port, held by another cluster's agent left on
    # this machine, failed every submit with "No available agent to submit job")
    agents = [f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
              f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}"]
    with ray_head(env, "--dashboard-host=127.0.0.1", f"--port={gcs}", f"--dashboard-port={dash}",
                  "--include-dashboard=true", *agents) as temp_dir:
        wd = tmp_path / "wd"  # a checkout, as `--working-dir .` ships one: its driver and actors must run
        for name in ("dynatree", "jobs", "actors"):
            shutil.copytree(ROOT / name, wd / name, ignore=shutil.ignore_patterns("assets", "__pycache__"))
        shutil.copy(ROOT / "pyproject.toml", wd)
        for module in ("jobs/driver.py", "actors/worker.py"):
            with open(wd / module, "a") as f:
                f.write(f"\nopen({str(tmp_path / Path(module).stem)!r} + '.ran', 'w').write(__file__)\n")
        pq.write_table(pa.table({"text": ["The quick brown fox", "It was the best", "Call me"]}),
                       wd / "prompts.parquet")
        out = tmp_path / "out"
        url = f"http://127.0.0.1:{dash}"
        deadline = time.time() + 90
        while True:  # wait for the job server
            probe = subprocess.run([str(bindir / "ray"), "job", "list", "--address", url], env=env,
                                   capture_output=True, text=True)
            if probe.returncode == 0:
                break
            assert time.time() < deadline, probe.stderr[-2000:]
            time.sleep(2)
        # without the token the job server refuses the client
        noauth = {k: v for k, v in env.items() if k != "RAY_AUTH_TOKEN"}
        noauth["RAY_AUTH_TOKEN_PATH"] = str(tmp_path / "no-token")
        (tmp_path / "no-token").write_text("wrong-token-0000")
        denied = subprocess.run([str(bindir / "ray"), "job", "list", "--address", url], env=noauth,
                                capture_output=True, text=True, timeout=120)
        assert denied.returncode != 0
        deadline = time.time() + 150
        while True:  # (the job server answers before its agent is up on a loaded host: Ray says to try again)
            res = subprocess.run(
                [str(bindir / "ray"), "job", "submit", "--address", url, "--working-dir", str(wd), "--",
                 "dynatree", "run", "--input", "prompts.parquet", "--output", str(out),
                 "--target", str(pair_dirs / "target"), "--draft", str(pair_dirs / "draft"),
                 "--max-new-tokens", "6", "--num-actors", "1", "--cpus-per-actor", "1",
                 "--verify-fraction", "1", "--device", "cpu", "--dtype", "float64", "--quiet"],
                env=env, capture_output=True, text=True, timeout=600)
            if "No available agent to submit job" not in res.stderr or time.time() > deadline:
                break
            time.sleep(3)
        agent_log = next(Path(temp_dir).glob("session_*/logs/dashboard_agent.log"), None)
        assert res.returncode == 0, (res.stdout + res.stderr)[-3000:] + (
            "\nthe head's dashboard agent log:\n" + agent_log.read_text()[-3000:] if agent_log else "")
        summary = json.loads((out / "summary.json").read_text())
        assert summary["rows"] == 3 and summary["equivalence"]["mismatches"] == 0
        for module in ("driver", "worker"):
            ran = (tmp_path / f"{module}.ran").read_text()  # (Ray unpacks the working dir elsewhere)
            assert not ran.startswith(str(ROOT)) and "working_dir" in ran, ran


def test_a_local_job_too_big_for_this_machine_fails_before_ray_starts(pair_dirs, tmp_path):
    """Without --address the job's cluster is this machine: actors it cannot hold (CPUs, memory
    past all it has) are refused before a Ray cluster starts (it started one, then refused ~15 s
    later), dry run or not."""
    pq.write_table(pa.table({"text": ["a prompt"]}), tmp_path / "in.parquet")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cpus = os.cpu_count() or 1
    for flags in (["--cpus-per-actor", str(cpus + 1)], ["--num-actors", str(cpus + 1), "--cpus-per-actor", "1"],
                  ["--dry-run", "--cpus-per-actor", str(cpus + 1)], ["--memory-per-actor", "100000"]):
        res = subprocess.run([str(Path(sys.executable).parent / "dynatree"), "run", "--input", str(tmp_path / "in.parquet"),
                              "--output", str(tmp_path / "out"), "--target", str(pair_dirs / "target"),
                              "--draft", str(pair_dirs / "draft"), "--device", "cpu", *flags],
                             env=env, capture_output=True, text=True, timeout=120)
        assert res.returncode == 1 and "cannot place" in res.stderr and "this machine" in res.stderr, res.stderr[-2000:]
        assert "Ray instance" not in res.stderr and not (tmp_path / "out").exists()


def test_unplaceable_requests_fail_within_a_minute(pair_dirs, tmp_path):
    """On a real 2-CPU head started by hand, requests it cannot hold end with a message naming
    the shortfall (they used to wait forever)."""
    bindir = Path(sys.executable).parent
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    env.pop("RAY_ADDRESS", None)
    gcs = free_port()
    with ray_head(env, f"--port={gcs}", "--include-dashboard=false"):
        deadline = time.time() + 90
        while subprocess.run([str(bindir / "ray"), "status", "--address", f"127.0.0.1:{gcs}"], env=env,
                             capture_output=True).returncode != 0:  # wait for the head
            assert time.time() < deadline, "the Ray head did not start"
            time.sleep(2)
        pq.write_table(pa.table({"text": [f"prompt {i}" for i in range(12)]}), tmp_path / "in.parquet")
        cases = [(["--num-actors", "2", "--cpus-per-actor", "2"], "at most 1"),
                 (["--num-actors", "3", "--cpus-per-actor", "1"], "at most 2"),
                 (["--cpus-per-actor", "4"], "cpus-per-actor")]
        for flags, expect in cases:
            t0 = time.time()
            res = subprocess.run(
                [str(bindir / "dynatree"), "run", "--input", str(tmp_path / "in.parquet"), "--output",
                 str(tmp_path / "out"), "--target", str(pair_dirs / "target"), "--draft", str(pair_dirs / "draft"),
                 "--address", f"127.0.0.1:{gcs}", "--shard-size", "2", "--max-new-tokens", "8", "--quiet",
                 "--device", "cpu", *flags],
                env=env, capture_output=True, text=True, timeout=120)
            assert res.returncode != 0 and time.time() - t0 < 60, res.stderr[-2000:]
            assert "cannot place" in res.stderr and expect in res.stderr, res.stderr[-2000:]
            assert "Traceback" not in res.stderr


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_driver_killed_mid_job_resumes_every_id_once(pair_dirs, tmp_path, sig):
    """SIGKILL the driver (and the local cluster it started) while batched actors are busy, or
    SIGTERM it alone (`ray job stop`, a scheduler): the re-run finishes with every id exactly
    once, every row equal to ar.  SIGTERM ends the job as Ctrl-C does: exit 143, the resume
    message, no native stack dump, the Ray processes it started gone.  (Rows long enough that
    the job outlasts a poll on a fast host: at 40 tokens a Zen 5 finished all 12 shards before
    the kill landed.)"""
    n = 32
    pq.write_table(pa.table({"key": [f"r{i}" for i in range(n)],
                             "text": [f"The quick brown fox {i} jumps over" for i in range(n)]}), tmp_path / "in.parquet")
    cmd = [str(Path(sys.executable).parent / "dynatree"), "run", "--input", str(tmp_path / "in.parquet"),
           "--output", str(tmp_path / "out"), "--target", str(pair_dirs / "target"), "--draft",
           str(pair_dirs / "draft"), "--id-column", "key", "--shard-size", "2", "--batch-size", "4",
           "--max-new-tokens", "120", "--ignore-eos", "--num-actors", "1", "--cpus-per-actor", "1",
           "--verify-fraction", "1", "--device", "cpu", "--quiet"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    shards = tmp_path / "out" / "shards"
    deadline = time.time() + 240
    try:
        while not (shards.exists() and len(list(shards.glob("part-*.parquet"))) >= 2):
            assert proc.poll() is None and time.time() < deadline, "the job ended before it could be killed"
            time.sleep(0.05)
        if sig == signal.SIGTERM:
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=60)
            said = r"terminated \(SIGTERM\): \d+ of 16 shards \(\d+ of 32 rows\) are finished; finished shards are kept"
            assert proc.returncode == 143 and re.search(said, err), err[-2000:]  # (how far it got: the failed-jobs trial)
            assert "SIGTERM received" not in err
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the driver and the Ray processes it started
            outlived = True
        except ProcessLookupError:  # none left in its process group
            outlived = False
        proc.wait(timeout=60)
    assert sig == signal.SIGKILL or not outlived, "Ray processes outlived a driver ended by SIGTERM"
    assert len(list(shards.glob("part-*.parquet"))) < n // 2
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming" in res.stderr
    t = pq.read_table(shards)
    assert sorted(t.column("id").to_pylist()) == sorted(f"r{i}" for i in range(n))
    assert all(t.column("matches_ar").to_pylist())


def test_a_shipped_checkout_runs_its_own_driver_and_actors(tmp_path):
    """`ray job submit --working-dir .` puts the checkout's copy first on the path: its
    dynatree.jobs and dynatree.actors, not the installed ones, must load with its dynatree."""
    for name in ("dynatree", "jobs", "actors"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("assets", "__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    code = ("import dynatree, dynatree.cli, dynatree.jobs.driver, dynatree.actors.worker as w, pkgutil; "
            "print(dynatree.__file__, dynatree.jobs.driver.__file__, w.__file__); "
            "print(sorted(m.name for m in pkgutil.iter_modules(dynatree.__path__) if m.ispkg))")
    got = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)},
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    files, packages = got.stdout.splitlines()
    assert len(files.split()) == 3 and all(f.startswith(str(tmp_path)) for f in files.split()), files
    assert packages == "[]", packages  # (nothing else of the checkout shows up inside the package)

