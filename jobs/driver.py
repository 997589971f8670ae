"""The batch driver: plans shards over the input, feeds them to Ray actors, writes Parquet, resumes.

The driver never touches tensors and never holds the whole input: it reads one shard's rows
(plan.Plan, data.InputSource) when an actor has room for it, sends ``{"id", "text"}`` rows, and
writes the returned result rows plus the shard's kept input columns.  Each actor keeps enough
shards queued to fill its batch (``JobSpec.inflight_shards``) and decodes them together.

Output directory::

    OUT/manifest.json              job identity, input fingerprint, shard count
    OUT/shards/part-NNNNNN.parquet one file per shard, written to a temp name then renamed
    OUT/summary.json               throughput, start-up, acceptance, equivalence, errors, config

A shard file exists only when complete, so a killed driver loses at most the shards in
flight; re-running on the same directory skips finished shards.  A re-run whose output
identity or input differs is refused unless ``overwrite`` (plan.prepare_output).  Actors that
the cluster cannot hold fail the job with a message (placement.py), never a silent wait.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import stat
import sys
import time
from collections import deque
from pathlib import Path

import pyarrow as pa

from dynatree.data import InputError, id_strings, jsonl_bytes, would_read
from dynatree.parts import each_repeated
from dynatree.signals import end_on_sigterm, held_while_starting, terminated_now
from dynatree.names import (TOKENIZER_FILES, context_len, default_pair_dir, lacks_tokenizer, model_config,
                            model_problem, native_refusal, no_tree_mask)
from dynatree.machine import ensure_writable
from dynatree.metrics import counted, output_schema
from dynatree.config import SLOW_ON_CPU, grows_trees, unused_options

from . import footprint, placement, runs
from .plan import (JobError, OutputHeld, Plan, as_stored, check_output, check_unlocked, default_ids, finished_shards,
                   make_plan, output_lock, pin_context, pin_prompt_start, pin_text_rule, prepare_output,
                   refuse_changed_input_early, shard_number, start_over, unwritable, write_shard)
from .spec import MAX_INFLIGHT, OUTPUT_IDENTITY, JobSpec
from .summary import ShardUnreadable, every_row_failed, previous_decoding_run, summarize, write_summary

__all__ = ["ClusterLost", "JobError", "MismatchError", "run_job"]

QUIET_S = 600.0  # no shard finished for this long: the driver says what is in flight (_say_quiet)
RESTART_POLL_S = 2.0  # while a replacement actor starts: how often its deadline is checked
HEALTH_S = 10.0  # how often the head is checked, shards finishing or not (Ray's client gives up on it after 60 s)
HEAD_LOST_S = 20.0  # a head not answering this long (and no actor death to confirm it) is lost: said before Ray's 60 s
CONNECT_S = 5.0  # how long a check waits for the head's port (a lost machine answers nothing)
REPLACE_FACTOR = 5.0  # a replacement actor is given this many times the first actors' start-up,
REPLACE_MIN_S = 120.0  # at least this, at most --ready-timeout-s
LONG_SCAN_BYTES = 200e6  # JSONL input that takes planning long enough to say so first
NODE_LOSSES = 3  # a shard whose actors were lost with their nodes more often than this is retried as a suspect


def _progress(total: int, done: int = 0):
    """The bar over the job's rows, ``done`` of them decoded by earlier runs (a resumed job read 60/160
    where it was far further along: the observability trial)."""
    try:
        from tqdm import tqdm
        return tqdm(total=total + done, initial=done, unit="row", file=sys.stderr, dynamic_ncols=True, smoothing=0.1,
                    disable=None)  # None: no bar when stderr is not a terminal (a log file, CI)
    except ImportError:
        return None


def _above(bar, log, message: str) -> None:
    """``log(message)`` on a line of its own above the progress bar, which is drawn again below it."""
    with bar.external_write_mode(file=sys.stderr):
        log(message)


class _LogProgress:
    """Progress for a log file (stderr not a terminal: `ray job submit`, nohup) where no bar is
    drawn: a line when a shard finishes at least ``every_s`` seconds after the last line, so a
    job of hours is not silent."""

    def __init__(self, total: int, log, every_s: float = 30.0, before: int = 0):
        self.total, self.log, self.every_s, self.done, self.before = total, log, every_s, 0, before
        self.t0 = self.last = time.time()

    def update(self, rows: int, tokens: int) -> None:
        self.done += rows
        now = time.time()
        if now - self.last >= self.every_s and self.done < self.total and now > self.t0:
            self.last, rate = now, self.done / (now - self.t0)
            left, job = (self.total - self.done) / rate, self.total + self.before
            eta = f"{left / 60:.0f} min" if left >= 60 else f"{left:.0f} s"
            self.log(f"progress: {self.done + self.before}/{job} rows ({100 * (self.done + self.before) / job:.1f}%"
                     f"{f'; {self.before} decoded by earlier runs' if self.before else ''}), "
                     f"{tokens / (now - self.t0):.1f} tok/s, ~{eta} left")


def _actor_shape(spec: JobSpec, resources: dict) -> tuple[int | None, float, float]:
    gpus = spec.gpus_per_actor
    if gpus is None:
        gpus = 1.0 if resources.get("GPU", 0) >= 1 and not spec.cpu_only else 0.0
    return spec.num_actors, spec.cpus_per_actor, gpus  # num_actors None: as many as fit


def _init_ray(spec: JobSpec, log=print):
    import ray

    # (Ray >= 2.52, with token authentication; an empty tuple catches nothing on older ones)
    AuthenticationError = getattr(ray.exceptions, "AuthenticationError", ())  # noqa: N806

    if ray.is_initialized():  # a Python caller's ray.init(): that connection is the one used
        if spec.address:
            log(f"note: Ray is already initialized in this process (cluster {ray.get_runtime_context().gcs_address}): "
                f"the job runs there, not at --address {spec.address}")
        return ray
    address = spec.address or os.environ.get("RAY_ADDRESS")  # RAY_ADDRESS: inside `ray job submit`
    try:
        if address:
            _probe(address, "--address" if spec.address else "RAY_ADDRESS")
            ray.init(address=spec.address, log_to_driver=True)
        else:
            _warn_if_shared(log)
            with held_while_starting(getattr(getattr(ray, "_private", None), "utils", None)):
                start_local_ray(log_to_driver=True)
    except AuthenticationError as e:  # (a token asked for by RAY_AUTH_MODE=token that cannot be read, ...)
        raise JobError(f"Ray token authentication failed{f' for the cluster at {address}' if address else ''}: "
                       f"{e}") from e
    except ConnectionError as e:
        raise JobError(f"cannot reach the Ray cluster at {address}: {e} {_connect_hint(e)}") from e
    except OSError as e:  # (a read-only HOME: Ray's token auth writes ~/.ray -- said as the job's own I/O error)
        where = f"connecting to the Ray cluster at {address}" if address else "starting the local Ray cluster"
        raise JobError(f"{where} failed: {e} (Ray writes its session under --temp-dir or /tmp/ray, and with token "
                       "authentication its token under ~/.ray: a read-only home or temporary directory stops it; "
                       "RAY_TMPDIR or a writable HOME moves it)") from e
    except Exception as e:  # (Ray's own start-up timeout is a plain Exception: trial AD, on a busy machine)
        if address or "timed out during startup" not in str(e):
            raise
        raise JobError(f"the local Ray cluster did not start: {e} (a busy machine starts it slowly: run the command "
                       "again, or start a head once with `ray start --head` and pass its --address)") from e
    end_on_sigterm(only_if_asked=True)
    return ray


class MismatchError(JobError):
    """--fail-on-mismatch: the job finished -- its shards and summary are written -- with checked
    rows that differ from ar; ``summary`` is the job's summary."""

    def __init__(self, message: str, summary: dict):
        super().__init__(message)
        self.summary = summary


class ClusterLost(JobError):
    """The Ray cluster's head went away mid-job: the process ends at once after saying so (Ray's
    client would otherwise wait for it, then exit with its own fatal error).  ``summary``: the
    job's, where it went away as the last shard was written (every shard finished, summarized)."""

    summary: dict | None = None


ORPHANED_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")  # a cluster's agents, left when it was killed


def _warn_if_shared(log) -> None:
    """A local job's cluster counts every CPU of this machine as its own: say so when another Ray
    cluster runs here (another local job, a `ray start` head), whose actors would share the cores.
    Measured (2 cores, bench pair): two 1 x 2-CPU jobs at once made 670 tokens/s together against
    1513 for one alone -- each forward waits for its thread the other job's threads displaced --,
    two 1 x 1-CPU jobs 1900."""
    import ray  # noqa: F401 -- puts Ray's own copy of psutil on the path

    try:
        import psutil

        procs = list(psutil.process_iter(["name", "status", "ppid", "cmdline", "memory_info", "uids"]))
        raylets = [p.pid for p in procs  # (a zombie is a dead raylet no one reaped)
                   if p.info["name"] == "raylet" and p.info["status"] != psutil.STATUS_ZOMBIE]
        orphans = [p for p in procs if p.info["ppid"] == 1 and p.info["uids"] and p.info["uids"].real == os.getuid()
                   and (p.info["cmdline"] or [""])[0] in ORPHANED_AGENTS]
    except Exception:  # noqa: BLE001 -- advice only: never what stops a job
        return
    if orphans:  # (a SIGKILLed job leaves them, and they ignore SIGTERM: the failed-jobs trial)
        mib = sum(p.info["memory_info"].rss for p in orphans if p.info["memory_info"]) / 2**20
        log(f"note: {len(orphans)} Ray helper process(es) of a cluster that is gone hold {mib:.0f} MiB (a job killed "
            f"with SIGKILL leaves them): `kill -9 {' '.join(str(p.pid) for p in orphans)}` frees it")
    if raylets:
        log(f"warning: another Ray cluster runs on this machine (raylet pid {', '.join(map(str, raylets))}). This job "
            "starts its own, which counts all of this machine's CPUs as free: both clusters' actors would share "
            "the cores, and a forward whose threads share cores stalls at every step (two 2-CPU jobs on 2 cores "
            "made 0.44x one job's tokens/s together). Run one job at a time, or give each job its share of the "
            "cores (--num-actors x --cpus-per-actor, e.g. 1 x 1 each for two jobs on 2 CPUs).")


def start_local_ray(**kw):
    """A private local Ray cluster ("local": never attach to a cluster some earlier `ray start` left
    registered), without the dashboard `dynatree run` does not need.  (It asks for loopback; Ray
    2.60 still advertises the routable address: README, *Running on a Ray cluster*.)"""
    import ray

    if (store := _store_under_rlimit()) is not None and "object_store_memory" not in kw:
        kw["object_store_memory"] = store
    ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1", **kw)
    return ray


def _store_under_rlimit() -> int | None:
    """An object store that an address-space limit (``ulimit -v``, ``prlimit --as``) leaves room to
    map and a file size limit (``ulimit -f``) room to make, or None without either: Ray's default (~30% of RAM) is mapped by every process, and under an
    8 GiB limit the start died in Ray with a C++ stack (trial AE); an eighth of the limit worked."""
    import resource

    least = 80 * 2**20  # (Ray's least: 75 MiB)
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    fsize, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    stores = [max(least, soft // 8)] if soft != resource.RLIM_INFINITY else []
    if fsize != resource.RLIM_INFINITY:  # (the store is one file of its size: above `ulimit -f` Ray's node
        if fsize * 7 // 8 < least:  # died of SIGXFSZ, and the job said "a busy machine: run again", trial AK)
            raise JobError(f"the file size limit (`ulimit -f`: {fsize // 1024} KiB) is below what a local Ray cluster's "
                           f"object store needs ({least // 2**20} MiB, one file): raise it (`ulimit -f unlimited`), or "
                           "run on a cluster (--address)")
        stores.append(fsize * 7 // 8)
    if not stores:
        return None
    store = min(stores)
    default = placement.local_store()  # (never more than Ray's own: a bigger one it refuses -- the review)
    return store if default is None or store < default else None


def zombie_children() -> set[int]:
    """This process's children that exited and are not yet reaped (Ray reaps the processes of a
    local cluster only at its shutdown); from /proc (Linux; elsewhere none)."""
    me, out = str(os.getpid()), set()
    for proc in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, parent = proc.read_text().rsplit(")", 1)[1].split()[:2]  # (after the name, which may hold spaces)
        except (OSError, IndexError, ValueError):
            continue  # (gone meanwhile)
        if parent == me and state == "Z":
            out.add(int(proc.parent.name))
    return out


def own_cluster_died(before: set[int], settle_s: float = 0.5) -> bool:
    """Whether the local Ray cluster this driver started was hit by the signal that interrupted it:
    its processes are the driver's children, in its process group, so a SIGTERM sent to the group
    (`timeout`, systemd's control group, Slurm's scancel) reaches them too -- and releasing the
    actors then waited a minute for the lost head before Ray's client aborted the process (the
    corpus trial).  Ray's Python helpers exit at once on it (its GCS and raylet take seconds, or
    stay): a child that exited since ``before`` (zombie_children once the cluster was up) says so."""
    time.sleep(settle_s)  # (they got the signal when the driver did; exiting takes a moment)
    return bool(zombie_children() - before)


def _connect_hint(e: ConnectionError) -> str:
    if "client server failed" in str(e):  # Ray's proxier could not start this client's server
        return ("(the head reached, but its Ray client server could not start a session for this driver -- "
                "it happens when the head is busy; try again, and see ray_client_server_*.err in the head's logs)")
    return "(if the head uses token authentication, this client needs the same RAY_AUTH_MODE and token)"


def _probe(address: str, name: str = "--address", timeout_s: float = 5.0) -> None:
    """Fail fast when nothing listens at a HOST:PORT address, or a web server does (a dashboard's
    port given for the GCS's): ray.init would retry for minutes, printing only its own connection
    warnings.  An HTTP address or one without a port: say what to give (Ray's message blames
    RAY_ADDRESS).  ``name``: where the address came from."""
    import socket

    means = ""
    if address == "auto":
        address, means = _resolve_auto()
        if address is None:
            return  # nothing recorded: ray.init says so (or finds a GCS process to attach to)
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    gcs = "the head's GCS address, HOST:PORT with the port of `ray start --head --port` (6379 unless set)"
    if address.startswith(("http://", "https://")):  # (Ray's own message blames RAY_ADDRESS)
        local = " (or unset RAY_ADDRESS to run on this machine)" if name == "RAY_ADDRESS" else ""
        raise JobError(f"{name} {address} is an HTTP address (a Ray dashboard's, which `ray job submit --address` "
                       f"takes), not a cluster's: give {gcs}, or submit this job with `ray job submit`{local}")
    if not sep and "://" not in address and address != "local":  # ("local": ray.init starts one here)
        raise JobError(f"{name} {address}: give {gcs}, ray://HOST:PORT (a Ray client server's, 10001 unless set) or auto")
    if not port.isdigit() or "://" in host:
        return  # other schemes: Ray resolves them
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s) as sock:
            # (a GCS address only, and not under TLS: a ray:// client port may sit behind an HTTPS ingress
            # that answers plain bytes in HTTP/1, where ray.init would still get through)
            tls = os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")
            web = not address.startswith("ray://") and not tls and _answers_http1(sock)
    except OSError as e:
        if means:
            raise JobError(f"cannot reach the Ray cluster at {address}, which `auto` means here ({means}): nothing "
                           f"answers there ({e.strerror or e}); restart its head, or give another --address") from e
        what = "Ray client server address (port 10001 unless set)" if address.startswith("ray://") else "GCS address"
        whence = " (from RAY_ADDRESS: unset it to run on this machine)" if name == "RAY_ADDRESS" else ""  # (trial AM)
        raise JobError(f"cannot reach the Ray cluster at {address}{whence}: nothing answers there ({e.strerror or e}); "
                       f"is its head running (`ray start --head`), and is this its {what}?") from e
    if web:  # (ray.init would dial it for minutes: a web server is no GCS)
        raise JobError(f"{address} answers as a web server, not as a Ray cluster (a Ray dashboard, port 8265 unless "
                       f"set?): give {gcs}")


def _answers_http1(sock) -> bool:
    """Whether the server on ``sock`` answers HTTP/1 to the HTTP/2 preface that Ray's gRPC servers
    take (a GCS replies with an HTTP/2 SETTINGS frame, a Ray dashboard "HTTP/1.0 400 Bad Request").
    Anything else -- TLS, silence within half a second -- is left to ray.init."""
    try:
        sock.settimeout(0.5)
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        return sock.recv(8).lstrip().startswith((b"HTTP/", b"<"))  # (a status line, or a page without one)
    except OSError:
        return False


def _resolve_auto() -> tuple[str | None, str]:
    """The HOST:PORT that Ray's `auto` names (Ray's own resolver: RAY_ADDRESS, else a running
    local GCS or the last `ray start`'s record), and whence -- (None, "") where it finds none (ray.init
    says so) or the resolver is not there.  Probed first: ray.init waits ~10 minutes on a recorded
    head that is gone, deaf to Ctrl-C."""
    try:
        from ray._private import services  # (private: another Ray version may lack it)

        address = services.get_ray_address_from_environment("auto", None)
        recorded = services.find_bootstrap_address(None)
    except Exception:  # noqa: BLE001 -- ConnectionError (none found), an unreadable record: ray.init reports
        return None, ""
    if os.environ.get("RAY_ADDRESS") not in (None, "", "auto"):
        return address, "RAY_ADDRESS"
    if address and address == recorded:
        return address, "the cluster the last `ray start` on this machine recorded; `ray stop` clears a stale record"
    if address:  # (Ray attaches to whichever GCS process it finds: another job's private cluster, which ends with it)
        record = f" (its record names {recorded}, which does not answer)" if recorded else ""
        raise JobError(f"--address auto: Ray would attach to {address}, a cluster it finds running on this machine, "
                       f"not a head `ray start` recorded here{record} -- another job's own cluster, say, which ends "
                       "with that job: give --address HOST:PORT of the head you mean, or no --address for a cluster "
                       "of this job's own")
    return None, ""


def preflight(spec: JobSpec) -> None:
    """Problems found before any actor starts: missing model paths, mismatched tokenizers, a local
    job's actors this machine cannot hold (a GPU it lacks, more CPUs or memory than it has)."""
    _check_this_machine(spec)
    check_models(spec)


def check_models(spec: JobSpec) -> None:
    """The models' problems a driver can see without loading them (paths, tokenizers, context,
    stop ids, a draft that cannot grow trees, a chat template): JobError saying which."""
    names = {"--target": spec.target, "--draft": spec.draft if spec.method != "ar" else None}
    for flag, name in names.items():
        problem = model_problem(name) if name else None
        if problem:
            raise JobError(f"{flag} {name}: {problem}")
    t, d = _model_dirs(spec)
    _check_context(spec, [p for p in (t, d) if p is not None])
    _check_stop_ids(spec, t)
    _check_draft_trees(spec, d)
    _check_native_only(spec, t, d)
    if t is not None and lacks_tokenizer(t):
        raise JobError(f"the target ({spec.target or 'the bundled demo pair'}) has no tokenizer (none of "
                       f"{', '.join(TOKENIZER_FILES)}), and a job's prompts are text")
    if spec.chat_template and t.is_dir() and not _has_chat_template(t):
        raise JobError(f"--chat-template: the tokenizer of the target ({spec.target or 'the bundled demo pair'}) "
                       "has no chat template")
    if t is None or d is None or not (t.is_dir() and d.is_dir()):
        return
    tj, dj = t / "tokenizer.json", d / "tokenizer.json"
    if tj.exists() and dj.exists() and tj.read_bytes() == dj.read_bytes():
        return  # the common case, without importing transformers in the driver
    from dynatree.models import PairError, tokenizer_difference, load_tokenizer
    try:
        tt, dt = load_tokenizer(str(t)), load_tokenizer(str(d))
    except PairError:
        return
    if tt is None or dt is None:
        return  # a draft directory without tokenizer files: the actor trusts the target's
    reason = tokenizer_difference(tt, dt)
    if reason:
        raise JobError(f"target {spec.target} and draft {spec.draft} do not share a tokenizer: {reason}")


def _check_draft_trees(spec: JobSpec, draft: Path | None) -> None:
    """A draft whose attention takes no tree mask serves ``linear`` only (names.no_tree_mask): a
    tree method with it is refused here (its config.json: a local one, or a cached hub copy's),
    not once Ray and the actors have started (their load probe finds it by trying,
    models.ModelPair.method_problem)."""
    config = model_config(draft) if draft is not None and grows_trees(spec.method_config) else None
    why = config and no_tree_mask(config)
    if why:
        raise JobError(f"--method {spec.method}: the draft model cannot expand token trees ({why}): "
                       "use --method linear, or another draft")


def _check_native_only(spec: JobSpec, target: Path | None, draft: Path | None) -> None:
    """--kernel lean-bf16 runs on the native kernel only: a model whose config.json rules it out
    (names.native_refusal) is refused here -- a dry run had passed, and the job failed once Ray and
    every actor's load had run (the Llama-family trial)."""
    if spec.kernel != "lean-bf16":
        return
    for which, path in (("target", target), ("draft", draft)):
        config = model_config(path) if path is not None else None
        why = config and native_refusal(config)
        if why:
            raise JobError(f"--kernel lean-bf16 runs on dynatree's native kernel, which does not take the {which} "
                           f"model ({why}): use --kernel lean, which runs such a model on torch's or transformers' "
                           "forward")


def _model_dirs(spec: JobSpec) -> tuple[Path | None, Path | None]:
    """The target's and the draft's paths as given (None: no draft; the bundled demo pair's
    without --target)."""
    if spec.target is None:
        return default_pair_dir() / "target", default_pair_dir() / "draft" if spec.method != "ar" else None
    draft = spec.draft if spec.method != "ar" else None
    return Path(spec.target).expanduser(), Path(draft).expanduser() if draft else None


def _context(model_dir: Path) -> int | None:
    """A model's context from its config.json (names.model_config; None: none to read)."""
    config = model_config(model_dir)
    return context_len(config) if config is not None else None


def _footprint(spec: JobSpec) -> footprint.Footprint | None:
    """A CPU actor's memory for this job, where every model it loads is a local checkpoint."""
    dirs = [p for p in _model_dirs(spec) if p is not None]
    return footprint.estimate(spec, dirs, _context(dirs[0])) if all(p.is_dir() for p in dirs) else None


def _has_chat_template(model_dir: Path) -> bool:
    """Whether a local tokenizer carries a chat template (its own file, or in its config)."""
    if (model_dir / "chat_template.jinja").is_file() or (model_dir / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


def _check_stop_ids(spec: JobSpec, target: Path | None) -> None:
    """A stop token id past the target's vocabulary (its config.json) fails every actor; say so first."""
    config = model_config(target) if spec.stop_token_ids and target is not None else None
    if config is None:
        return
    vocab = config.get("vocab_size")
    bad = [i for i in spec.stop_token_ids if vocab and i >= vocab]
    if bad:
        raise JobError(f"--stop-token-id {bad[0]} is outside the target's vocabulary (0 .. {vocab - 1})")


def _check_context(spec: JobSpec, dirs: list[Path]) -> None:
    """A cache window the models' context cannot hold, or a generation that leaves no room for a
    prompt, fails every row; say so before any work (from the models' config.json: local, or a
    cached hub copy's; the engine checks others, row by row)."""
    from dynatree.config import ContextError, check_window, window_limit

    cfg = spec.method_config
    ctx = _context(dirs[0])  # (the target's: a draft with fewer positions restarts within them, Drafter.positions)
    if ctx is None:
        return
    if not getattr(cfg, "kv_window", 0) and spec.max_new_tokens >= ctx:
        raise JobError(f"--max-new-tokens {spec.max_new_tokens} leaves no room for a prompt in the target's "
                       f"{ctx}-token context (or generate past it with a cache window: --option kv_window=...)")
    try:
        check_window(cfg, *window_limit(cfg, ctx, _context(dirs[1]) if len(dirs) > 1 else None))
    except ContextError as e:
        raise JobError(str(e)) from None
    if getattr(cfg, "kv_window", 0):
        from dynatree.names import window_refusal

        for p in dirs:
            config = model_config(p)
            why = config and window_refusal(config)
            if why:
                raise JobError(f"{p}: {why}")


def _check_output_outside_input(spec: JobSpec) -> None:
    """An output the input reads (a directory's subdirectory, a matching glob) would be read back
    as input by the next run."""
    try:
        out = Path(spec.output).resolve()  # (the directory itself too: a glob matching it reads it as a file)
        str(out).encode("utf-8")  # (pyarrow opens paths as UTF-8 only: it failed at the first shard, trial AK)
    except UnicodeEncodeError as e:
        raise JobError(f"--output {spec.output!r} is not a UTF-8 name, which the shards' writer needs: rename it") from e
    except (RuntimeError, OSError) as e:  # (Python 3.11: a symlink loop is a RuntimeError)
        raise JobError(f"--output {spec.output}: {e}") from e
    try:
        with contextlib.suppress(FileNotFoundError):  # (Path.exists says False for any error)
            if not stat.S_ISDIR(os.stat(out).st_mode):
                raise JobError(f"--output {spec.output} is a file, not a directory: name a directory (it is created)")
        other = next((p.parent for p in [out, *out.parents] if p.name == "shards" and (p.parent / "manifest.json").is_file()),
                     None)
    except OSError as e:  # (a directory not to be entered, a name too long: a traceback, twice: trial AK)
        raise JobError(f"--output {spec.output} cannot be used: {e.strerror or e}"
                       + (f" ({e.filename})" if e.filename else "")) from e
    if other is not None:  # (its readers would read this job's files as its rows: trial AK)
        raise JobError(f"--output {spec.output} lies in {other / 'shards'}, where the dynatree output {other} keeps its "
                       "shards (read as one dataset): write it elsewhere")
    if any(would_read(spec.input, str(out / f)) for f in ("", "shards/part-000000.parquet", "manifest.json")):
        raise JobError(f"--output {spec.output} is where the input {spec.input} reads: a re-run would read the "
                       "job's own output as input; write it elsewhere")


def _check_this_machine(spec: JobSpec) -> None:
    """A job without --address runs its actors on this machine: --device cuda needs a GPU here,
    and its actors' CPUs, GPUs and memory must fit it -- known before Ray starts (found after the
    cluster's start, the output begun, or ~15 s later)."""
    if spec.address or os.environ.get("RAY_ADDRESS"):  # (set inside `ray job submit`: the cluster's nodes run it)
        return

    if spec.device.startswith("cuda") and not placement.local_gpus(cuda=True):
        raise JobError(f"--device {spec.device}: this machine has no CUDA GPU, and a job without --address runs "
                       "here; use --device cpu or auto")
    memory = spec.memory_per_actor * 1e9 if spec.memory_per_actor else None
    local = _local_shape(spec, "this machine (no --address: the job runs here)", memory=bool(memory))
    if local is None:  # (a Python caller's cluster: placement checks it once connected)
        return
    node, n, cpus, gpus = local
    try:
        placement.check_request([node], n, cpus, gpus, memory, spec.resources_per_actor)
    except placement.PlacementError as e:
        raise JobError(str(e)) from e


def _local_shape(spec: JobSpec, name: str, memory: bool) -> tuple[dict, int | None, float, float] | None:
    """This machine as the node a local job's cluster will have, and the job's actor shape on it
    (``memory``: with the memory Ray will offer); None where the job runs on a cluster (--address,
    RAY_ADDRESS, or a Python caller's ray.init)."""
    import ray

    if spec.address or os.environ.get("RAY_ADDRESS") or ray.is_initialized():
        return None
    node = placement.local_node(name, memory=memory)
    return (node, *_actor_shape(spec, node["Resources"]))


def _forwarded_env() -> dict[str, str]:
    """The driver's DYNATREE_* settings (the kernel variant, the cache, profiling ...) and CC, for
    the actors: on a cluster's nodes they read the node's environment, not the shell that ran the
    job (DYNATREE_ISA=generic ran avx512 there: the concurrent-jobs trial).  The fault-injection
    hook of the tests (spec.FAULTS_ENV) is one of them."""
    env = {k: v for k, v in os.environ.items() if k.startswith("DYNATREE_") or k == "CC"}
    if env.get("DYNATREE_CACHE") and not env["DYNATREE_CACHE"].startswith("~"):  # (an actor's working directory
        env["DYNATREE_CACHE"] = os.path.abspath(env["DYNATREE_CACHE"])          # is not the driver's; ~ is its own)
    return env


def _local_cpu_only(spec: JobSpec) -> bool:
    """Actors that will run on this machine's CPUs: no --address, and no GPU an actor (the run's
    own rule, _actor_shape, over this machine)."""
    if spec.address or os.environ.get("RAY_ADDRESS"):
        return False
    return not _actor_shape(spec, placement.local_node("this machine")["Resources"])[2]


def _warn_if_submitted_relative(spec: JobSpec, log) -> None:
    """Under `ray job submit` a relative path lies in the job's working directory, which Ray
    manages: an output there may be deleted; an input or model in a --working-dir's copy is named
    by a path holding the copy's hash, so the next submission -- with any file of the directory
    changed -- is another job, which cannot resume this one's output."""
    if not os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):  # (set by `ray job submit`)
        return
    if not os.path.isabs(spec.output):
        log(f"warning: --output {spec.output} is relative: under `ray job submit` it is {os.path.abspath(spec.output)}, "
            "in the job's working directory, which Ray manages and may delete; give an absolute path")
    here = os.getcwd()
    if "_ray_pkg_" not in here:  # (not a --working-dir's copy, whose name is its files' hash)
        return
    for flag, path in (("--input", spec.input), ("--target", spec.target), ("--draft", spec.draft)):
        if path and os.path.isabs(path) and Path(path).is_relative_to(here):  # (paths are absolute by now)
            log(f"warning: {flag} {path} lies in the copy of the working directory `ray job submit` made, whose name "
                "changes with any of its files, and the output's identity holds the path: resuming after such a "
                "change is refused; give a path outside it (a shared filesystem's on a cluster)")


def run_job(spec: JobSpec, *, progress: bool = True, log=print, dry_run: bool = False) -> dict:
    """Run (or resume) a job; returns the summary.  Raises JobError on fatal problems.
    ``dry_run``: every check a run makes before it starts Ray, nothing written; returns the plan."""
    t_start = time.time()
    _warn_if_submitted_relative(spec, log)
    if note := unused_options(spec.method_config):
        log(f"note: {note}")
    _check_output_outside_input(spec)
    refuse_changed_input_early(spec)  # (before a scan that would only find it again)
    if (n := jsonl_bytes(spec.input)) >= LONG_SCAN_BYTES:  # (minutes of silence read as a hang: the corpus trial)
        log(f"planning: reading {n / 1e9:.1f} GB of JSONL input to count and type its rows "
            "(every line is read: minutes per GB on a small machine; Parquet plans from its metadata)")
    spec, source = default_ids(spec, log)
    plan = make_plan(spec, log, source)
    preflight(spec)
    if dry_run:
        if _local_cpu_only(spec) and spec.dtype in SLOW_ON_CPU:  # (the run says it once its actors are placed)
            log(f"warning: CPU actors: {SLOW_ON_CPU[spec.dtype]}")
        return _dry_run(spec, plan)
    created = not os.path.lexists(spec.output)
    try:
        with output_lock(spec.output):
            return _run_planned(spec, plan, t_start, progress, log)
    except OutputHeld:  # (made by the job that holds it, in between: removing it deleted that job's output)
        raise
    except BaseException:
        if created:
            _remove_unused(Path(spec.output))
        raise


def _remove_unused(out: Path) -> None:
    """The output directory a failed run created, removed if the run wrote no shard into it (a
    cluster it could not reach, actors that never loaded): a directory with only a manifest in it
    pins nothing, but it is clutter left by a typo.  Anything else in it is kept."""
    if not out.is_dir() or {p.name for p in out.iterdir()} - {"manifest.json", ".dynatree.lock", "shards", runs.RUNS}:
        return
    with contextlib.suppress(OSError):  # (a failure before shards/ was made: none to remove, go on)
        (out / "shards").rmdir()  # (only if empty)
    if (out / "shards").exists():
        return  # a shard was written: the output and its manifest stay whole
    with contextlib.suppress(OSError):
        for name in ("manifest.json", ".dynatree.lock", runs.RUNS):
            (out / name).unlink(missing_ok=True)
        out.rmdir()


def _run_planned(spec: JobSpec, plan: Plan, t_start: float, progress: bool, log) -> dict:
    """The job once checked and planned, its output locked: resume, decode, summarize -- and the
    run's record (jobs/runs.py) however it ends; an --overwrite stopped before it cleared the output
    leaves the old job's output, records included, as it was."""
    out = prepare_output(spec, plan)
    startup = {"plan_s": round(time.time() - t_start, 3)}
    run_stats = {"rows_this_run": 0, "tokens_this_run": 0, "shards_this_run": 0, "retries": 0}
    record = runs.begin(plan, spec.overwrite, started=t_start)
    run_stats["_run"] = runs.run_ref(record)  # (each shard's footer names it)
    try:
        summary, gone = _decode(spec, plan, out, progress, log, record, run_stats, startup, t_start)
    except BaseException as e:  # (a failed or stopped run writes no summary: its record says how it ended)
        run_stats["wall_time_s"] = time.time() - t_start
        if run_stats.pop("_cleared", not spec.overwrite):
            with contextlib.suppress(AttributeError):  # (the command says how far it got)
                e.run_record = runs.end(out, record, _ended(e), str(e) or _STOPPED.get(_ended(e), ""), run_stats,
                                        startup)
        raise
    if gone:  # (the command exits without Ray's shutdown, which would wait a minute for the lost head)
        lost = ClusterLost("the Ray cluster's head stopped answering as the last shard was written: every shard is "
                           "finished and summarized, without its actors' statistics")
        lost.summary = summary
        raise lost
    if spec.fail_on_mismatch and summary["equivalence"]["mismatches"]:
        raise MismatchError(f"{summary['equivalence']['mismatches']} generation(s) differ from ar "
                            f"(--fail-on-mismatch); see summary.json", summary)
    return summary


def _decode(spec: JobSpec, plan: Plan, out: Path, progress: bool, log, record: dict, run_stats: dict,
            startup: dict, t_start: float) -> tuple[dict, bool]:
    """Decode the shards not done, then summarize every shard and complete the run's record; returns
    the summary and whether the cluster's head was lost as the last shard was written."""
    done, todo = _progress_of(out, spec, plan)
    runs.before(record, plan, done)
    if done:
        log(f"resuming: {len(done)} of {plan.num_shards} shards already done")
    redone = [] if spec.overwrite else _unfinished_files(out, plan, done)
    if redone:  # (a truncated or empty shard was redone without a word: the corpus trial)
        log(f"redoing {len(redone)} shard file(s) that are not whole or not this job's: {', '.join(redone[:5])}"
            + (" ..." if len(redone) > 5 else ""))
    if plan.num_shards == 0:
        log(f"the input {spec.input} has no rows; writing an empty dataset")
        if spec.overwrite:
            start_over(spec, plan)
            run_stats["_cleared"] = True
        write_shard(out, spec, plan, 0, plan.schema.empty_table(), runs.run_ref(record))
    if todo and not spec.overwrite:  # (a finished job's summary no longer says what the output holds: trials AJ,
        # AK; an --overwrite leaves the old output whole until start_over clears it: the review)
        with contextlib.suppress(FileNotFoundError):
            (out / "summary.json").unlink()
    if todo:
        _Dispatch(spec, plan, out, run_stats, startup, log).run(todo, progress)
    run_stats["wall_time_s"] = time.time() - t_start
    if plan.num_shards >= 2000:  # (~0.25 ms a shard's footer: not a silent wait at a corpus's end)
        log(f"summarizing {plan.num_shards} shards")
    _check_shards_there(out, plan, run_stats)
    gone = run_stats.pop("cluster_gone", False)
    complete = runs.finish(dict(record), "complete", "", run_stats, startup)
    try:
        summary = summarize(out, spec, run_stats, startup, previous_decoding_run(out), [*runs.read(out), complete])
    except ShardUnreadable as e:
        raise JobError(f"{e}: damaged since it was written? the same command decodes its rows again") from e
    if (failed := every_row_failed(summary)) is not None:
        complete.update(status="failed", message=failed)  # (summary["runs"] holds this record)
    write_summary(out, summary)
    runs.append(out, complete)  # (after the summary: a run stopped while summarizing is not "complete")
    return summary, gone


def _check_shards_there(out: Path, plan: Plan, run_stats: dict) -> None:
    """Every planned shard's file is in ``out`` as the job ends: one deleted or moved while it ran
    (a sync script taking results) made a "complete" job of missing rows (trial AK); the run's
    record then counts the shards left."""
    if not plan.num_shards:
        return
    with os.scandir(out / "shards") as entries:
        names = {e.name for e in entries}
    lost = [k for k in range(plan.num_shards) if plan.shard(k)[0] + ".parquet" not in names]
    gone = [plan.shard(k)[0] for k in lost]
    if gone:
        run_stats["_gone"] = (len(lost), sum(plan.shard(k)[2] - plan.shard(k)[1] for k in lost) * plan.samples)
        raise JobError(f"{counted(len(gone), 'shard file')} went missing while the job ran: {', '.join(gone[:5])}"
                       f"{' ...' if len(gone) > 5 else ''}; the same command decodes their rows again")


_STOPPED = {"interrupted": "interrupted (Ctrl-C, SIGINT)", "terminated": "terminated (SIGTERM)"}  # (a signal's
# KeyboardInterrupt says nothing: the record's message was "", trial AJ)


def _ended(e: BaseException) -> str:
    """How a run that raised ended, as its record says it (runs.STATUSES)."""
    if isinstance(e, KeyboardInterrupt):
        return "terminated" if terminated_now(e) else "interrupted"
    return "cluster_lost" if isinstance(e, ClusterLost) else "failed"


def _unfinished_files(out: Path, plan: Plan, done: set[int]) -> list[str]:
    """Shard files in ``out`` that finished_shards did not count (cut short, emptied, another
    job's range): their shards are decoded again and the files replaced."""
    shards = out / "shards"
    files = shards.glob("part-*.parquet") if shards.is_dir() else []
    return sorted(p.stem for p in files if (k := shard_number(p.name)) is not None and k < plan.num_shards
                  and k not in done)


def _progress_of(out: Path, spec: JobSpec, plan: Plan) -> tuple[set[int], list[int]]:
    """(shards finished, shards to do) of the job in ``out`` (--overwrite: none finished)."""
    done = finished_shards(out, spec, plan) if (out / "shards").is_dir() and not spec.overwrite else set()
    return done, [k for k in range(plan.num_shards) if k not in done]


def _dry_run(spec: JobSpec, plan: Plan) -> dict:
    """The plan of a run, checked against what the output holds (read only)."""
    check_unlocked(spec.output)
    check_output(spec, plan)
    out = Path(spec.output)
    # what prepare_output's probe finds, creating nothing: the run writes its lock and manifest in out
    # (or creates it in its nearest existing parent) and shards in out/shards; a probe file there, removed
    # (os.access said yes to root for /proc, where the run then failed)
    dirs = [next(p for p in (out, *out.parents) if p.exists()), *[out / "shards"] * (out / "shards").exists()]
    for d in dirs:
        try:
            ensure_writable(d)
        except OSError as e:
            raise JobError(unwritable(out, e) if isinstance(e, FileExistsError) else
                           f"output directory {out} is not writable: {d}: {e.strerror or e}") from None
    done, todo = _progress_of(out, spec, plan)
    rows = sum(plan.shard(k)[2] - plan.shard(k)[1] for k in todo)
    shown = {"id_column": spec.id_column or "(row index)", "keep_columns": plan.kept_names,
             "target": spec.target or "(the bundled demo pair's)",
             "draft": "(none: ar drafts nothing)" if spec.method == "ar" else spec.draft or "(the bundled demo pair's)"}
    return {"input_rows": plan.rows, "files": len(plan.source.files), "output": os.path.abspath(spec.output),
            "shards": plan.num_shards, "shards_done": len(done), "rows_to_decode": rows,
            "output_rows_to_write": rows * plan.samples,
            # every field of the job's identity (what a resume must match), as this run resolves it
            **{k: shown.get(k, getattr(spec, k)) for k in OUTPUT_IDENTITY if k != "options"},
            "batch_size": spec.batch_size, "overwrite": spec.overwrite,
            **({"overwrite_deletes": deletes} if (deletes := _overwrite_deletes(spec, out)) else {}),
            "actors": _actors_said(spec),
            "memory": _memory_said(spec),
            "options": dataclasses.asdict(spec.method_config)}


def _overwrite_deletes(spec: JobSpec, out: Path) -> str | None:
    """What --overwrite would delete in a dry run (a job file's overwrite: true had read as a plan
    to resume: the failed-jobs trial), or None."""
    held = len(list((out / "shards").glob("part-*.parquet"))) if spec.overwrite and (out / "shards").is_dir() else 0
    return (f"the {held} shard file(s) in {out / 'shards'}, its summary.json and runs.jsonl, once the actors are "
            "ready") if held else None


def _memory_said(spec: JobSpec) -> str:
    """A dry run's memory estimate, and for a local job what the run would say of this machine's
    memory (footprint.fit; the run says it once Ray is up: trial AE found the dry run silent)."""
    local = _local_shape(spec, "this machine", memory=True)
    node, n, cpus, gpus = local or (None, *_actor_shape(spec, {}))
    fp = None if spec.memory_per_actor or gpus else _footprint(spec)  # (as the run's _fit_memory)
    if fp is None:
        return "(no estimate: GPU actors, --memory-per-actor, or models whose sizes are not read here)"
    if local is None:
        return f"each actor needs {fp.describe()} (checked against the cluster's nodes when the job starts)"
    n = placement.check_request([node], n, cpus, gpus, None, spec.resources_per_actor)
    notes = footprint.fit(fp, [node], n, cpus, spec).notes
    return notes[0].removeprefix("memory: ") if notes else f"each actor needs {fp.describe()}: {n} fit this machine"


def _actors_said(spec: JobSpec) -> str:
    """A dry run's actors and where they run: a local job's were checked against this machine;
    a cluster's room is asked only when the job starts (a dry run starts and joins no Ray)."""
    import ray

    joined = ray.is_initialized()  # (a Python caller's connection: the job runs there, whatever --address says)
    address = None if joined else spec.address or os.environ.get("RAY_ADDRESS")
    local = not address and not joined
    n, cpus, gpus = _actor_shape(spec, {"GPU": placement.local_gpus()} if local else {})
    auto_gpu = spec.gpus_per_actor is None and not local and not spec.cpu_only  # (counted at the job's start)
    gpus = "1 if the cluster has one" if auto_gpu else f"{gpus:g}"
    custom = "".join(f", {k}: {v:g}" for k, v in spec.resources_per_actor.items())  # (--resource)
    shape = f"{n or 'as many as fit'} x {{CPU: {cpus:g}, GPU: {gpus}{custom}}}"
    if local:
        return shape + " on this machine (they fit)"
    where = ("this process's Ray cluster" if joined else "the cluster `auto` finds" if address == "auto"
             else f"the cluster at {address}")
    return shape + f" on {where} (not asked in a dry run: whether they fit is checked when the job starts)"


def _read_shard(spec: JobSpec, plan: Plan, k: int) -> tuple[list[dict], pa.Table]:
    """The shard's {"id", "text"} rows for the actor and its kept columns for the output."""
    _, s, e = plan.shard(k)
    id_col = [spec.id_column] if spec.id_column else []
    cols = list(dict.fromkeys([spec.prompt_column, *id_col, *plan.keep]))
    table, raw = plan.source.read(s, e, cols, raw=[spec.prompt_column])
    ids = id_strings(table.column(spec.id_column)) if spec.id_column else [str(i) for i in range(s, e)]
    kept = table.select(list(plan.keep)).rename_columns(plan.kept_names)
    return [{"id": i, "text": t} for i, t in zip(ids, raw[spec.prompt_column])], kept


def _shard_table(plan: Plan, rows: list[dict], results: list[dict], kept: pa.Table) -> pa.Table:
    n = plan.samples
    if [r["id"] for r in results] != [r["id"] for r in rows for _ in range(n)]:
        raise JobError("an actor returned rows that do not match its shard's ids")
    table = pa.Table.from_pylist(results, schema=output_schema(n > 1))
    names = plan.kept_names
    kept = pa.table({c: as_stored(kept.column(c), plan.schema.field(c).type) for c in names}) if names else kept
    kept = each_repeated(kept, n)  # every sample row carries its prompt's kept columns
    for c in names:
        table = table.append_column(plan.schema.field(c), kept.column(c))
    return table


def _unanswered_at(host: str, port: int) -> OSError | None:
    """Why ``host:port`` does not accept a connection within CONNECT_S (a lost machine answers
    nothing, a dead process's port refuses), or None where it does."""
    try:
        socket.create_connection((host, port), timeout=CONNECT_S).close()
        return None
    except OSError as e:
        return e


class _Dispatch:
    """Places the actors, keeps each one's queue of shards full, writes results, retries."""

    def __init__(self, spec: JobSpec, plan: Plan, out: Path, stats: dict, startup: dict, log):
        self.spec, self.plan, self.out, self.stats, self.startup, self.log = spec, plan, out, stats, startup, log
        self.share: float | None = None  # bytes of a node per actor, for auto's cap (_fit_memory)
        self.attempts: dict[int, int] = {}  # failures while running alone
        self.suspects: set[int] = set()  # shards in flight on an actor when it failed
        self.node_losses: dict[int, int] = {}  # shard -> actors it lost with their nodes
        self.restarts: dict[int, tuple] = {}  # slot -> (its replacement's ready() ref, deadline)
        self.unplaceable: dict[int, str] = {}  # slot -> why no alive node can hold its waiting replacement (said)
        self.actor_nodes: dict = {}  # actor handle -> the Ray node it was ready on
        self.gone_nodes: set[str] = set()  # nodes found gone (_node_gone)
        self.next_node_check = 0.0  # (when _say_unplaceable may ask the head for its nodes again)
        self.start_failures = 0  # replacements in a row that failed to load
        self.head_down_since: float | None = None  # first failed check of the head in a row
        self.head_checked = 0.0  # when the head was last checked (_wait)
        # shards that used up their retries or whose rows could not be read (runs.failed_shard): the
        # run's record keeps them however the run ends
        self.failed: list[dict] = stats.setdefault("failed_shards", [])

    def _start(self, ray, n: int) -> None:
        from dynatree.actors.ray_actor import PairActor

        spec, cpus, gpus = self.spec, self.cpus, self.gpus
        t0 = time.time()
        self.pg = placement.reserve(n, cpus, gpus, memory=self.memory, custom=spec.resources_per_actor,
                                    timeout_s=spec.placement_timeout_s, log=self.log)
        self.startup["placement_s"] = round(time.time() - t0, 3)
        env = _forwarded_env()
        threads = max(1, int(cpus))

        def start(i: int):
            return PairActor.options(**placement.actor_options(self.pg, i, cpus, gpus, self.memory,
                                                               spec.resources_per_actor), max_restarts=0,
                                     max_concurrency=self.inflight + 2,
                                     runtime_env={"env_vars": env} if env else None).remote(spec, threads, self.share)

        self.start_actor = start
        self.actors = [start(i) for i in range(n)]
        t0 = time.time()  # (what the actors do meanwhile, said: it was seconds to minutes of silence)
        self.log(f"loading the models on {n} actor(s) (a node's first job also builds the native kernel and profiles "
                 f"the hardware; at most --ready-timeout-s {spec.ready_timeout_s:g} s)")
        infos = placement.wait_ready([a.ready.remote() for a in self.actors], timeout_s=spec.ready_timeout_s,
                                     what="actor")
        self.startup["actors_ready_s"] = round(time.time() - t0, 3)
        # a replacement loads what the first actors loaded: far slower means it cannot be placed
        self.replace_timeout_s = min(spec.ready_timeout_s,
                                     max(REPLACE_MIN_S, REPLACE_FACTOR * self.startup["actors_ready_s"]))
        self.startup["actor"] = {k: round(max(i["startup"][k] for i in infos), 3) for k in infos[0]["startup"]}
        self.stats["forward"] = infos[0]["forward"]  # (summary.json: this_run)
        # every node an actor of this run was ready on, lost ones too (stats() asks the living at the end)
        self.stats["nodes"] = {i["node_id"]: i["node_ip"] for i in infos if "node_id" in i}
        self.actor_nodes = {a: i["node_id"] for a, i in zip(self.actors, infos) if "node_id" in i}
        if infos[0].get("draft_forward"):  # (a draft on transformers' forward made a job slow without a word)
            self.stats["draft_forward"] = infos[0]["draft_forward"]
        self.leading_ids = infos[0].get("leading_ids", [])
        self.texts_changed = infos[0].get("texts_changed", False)
        self.context = infos[0]["context"], infos[0].get("draft_positions", 0)  # (pinned with the output: pin_context)
        caps = sorted({i["batch_cap"] for i in infos if i.get("batch_cap") is not None})
        if caps:
            span = str(caps[0]) if len(caps) == 1 else f"{caps[0]}-{caps[-1]}"
            self.log(f"memory: --batch-size auto capped at {span} row(s) per actor, measured once loaded")
        self.log(f"{n} actor(s) ready: {infos[0]['device']}, {infos[0]['dtype']}, {cpus:g} CPU / {gpus:g} GPU "
                 f"each, context {infos[0]['context']}, batch size {spec.batch_size}; target forward: "
                 f"{infos[0]['forward']}" + (f"; draft forward: {infos[0]['draft_forward']}"
                                             if infos[0].get("draft_forward") else ""))

    def _inflight(self, shards: int, actors: int) -> int:
        """Shards queued per actor (JobSpec.inflight_shards): no more than the job has for it (each
        one is a thread of the actor, started with it), and said where the cap holds batches down."""
        spec, each = self.spec, -(-shards // actors) + 1
        if spec.max_inflight_per_actor is None and spec.inflight_shards == MAX_INFLIGHT < each:
            self.log(f"note: --batch-size {spec.batch_size} rows need more shards of --shard-size {spec.shard_size} "
                     f"in flight per actor than the {MAX_INFLIGHT} an actor takes: batches of at most "
                     f"~{(MAX_INFLIGHT - 1) * spec.shard_size} rows (a bigger --shard-size holds more)")
        return max(1, min(spec.inflight_shards, each))

    def _free_share(self, ray, n: int) -> int:
        """As many actors as the resources free now hold, where other jobs hold some of the n the
        nodes hold (the default --num-actors: a reservation of n would wait, then fail)."""
        custom, deadline = self.spec.resources_per_actor, time.monotonic() + 2.0
        while True:  # (a previous job's actors and group in this process are released asynchronously)
            avail = ray.available_resources()
            free = placement.free_actors(avail, n, self.cpus, self.gpus, self.memory, custom)
            if free >= n or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if free < n:
            held = placement.fmt_free(avail, self.cpus, self.gpus, self.memory, custom)
            self.log(f"starting {free} of the {n} actor(s) the cluster holds at this shape: other jobs or actors hold "
                     f"the rest ({held} free now; --num-actors {n} waits for them, up to --placement-timeout-s)")
        return free

    def run(self, todo: list[int], progress: bool) -> None:
        t0 = time.time()
        import ray

        own = not ray.is_initialized() and not (self.spec.address or os.environ.get("RAY_ADDRESS"))
        ray = _init_ray(self.spec, self.log)
        exited = zombie_children() if own else set()  # (Ray's own that exited before any signal)
        resources = ray.cluster_resources()
        if (no_gpu := placement.no_gpu(self.spec.device, resources)):
            raise JobError(no_gpu)
        n, self.cpus, self.gpus = _actor_shape(self.spec, resources)
        if not self.gpus and self.spec.dtype in SLOW_ON_CPU:
            self.log(f"warning: CPU actors: {SLOW_ON_CPU[self.spec.dtype]}")
        self.memory = self.spec.memory_per_actor * 1e9 if self.spec.memory_per_actor else None  # bytes
        try:
            n = placement.check_request(ray.nodes(), n, self.cpus, self.gpus, self.memory, self.spec.resources_per_actor)
        except placement.PlacementError as e:
            raise JobError(str(e)) from e
        if self.spec.num_actors is None:
            n = self._free_share(ray, n)
        if len(todo) < n:
            self.log(f"{len(todo)} shard(s) left to decode: starting {len(todo)} of {n} actors "
                     f"(a shard holds --shard-size {self.spec.shard_size} rows and goes to one actor)")
        n = self._fit_memory(ray, min(n, len(todo)))
        self.inflight = self._inflight(len(todo), n)
        self.startup["cluster_s"] = round(time.time() - t0, 3)
        self.actors, self.pg = [], None
        try:
            self._start(ray, n)
            if self.spec.overwrite:  # (only now: a job that cannot start leaves the old output whole)
                start_over(self.spec, self.plan)
                self.stats["_cleared"] = True  # (its run's record goes in the new output's runs.jsonl)
            pin_prompt_start(self.out, self.leading_ids)
            pin_context(self.out, self.spec, *self.context)
            pin_text_rule(self.out, self.texts_changed)
            self._loop(ray, deque((k, None) for k in todo), progress)
            self._actor_stats(ray)
        except placement.PlacementError as e:
            raise JobError(str(e)) from e
        except ClusterLost:
            self.actors, self.pg = [], None  # nothing left to release, and asking would wait for the head
            raise
        except KeyboardInterrupt as e:  # (Ctrl-C, SIGTERM)
            if own and own_cluster_died(exited):  # a SIGTERM to the process group: `timeout`, systemd, Slurm
                self.actors, self.pg = [], None
                e.cluster_gone = True  # (the command exits without Ray's shutdown: it would wait a minute)
            raise
        finally:
            for a in self.actors:
                if a is not None:
                    ray.kill(a)
            if self.pg is not None:
                placement.release(self.pg)
        if self.failed:
            said = "; ".join(runs.failure_said(f, self.spec.max_retries) for f in self.failed[:3])
            more = f" (and {len(self.failed) - 3} more)" if len(self.failed) > 3 else ""
            again = ("re-run without --overwrite (--no-overwrite where a job file sets overwrite: true) to decode only "
                     "those" if self.spec.overwrite else "a re-run decodes only those")
            raise JobError(f"{counted(len(self.failed), 'shard')} could not be decoded: {said}{more}; the rest are finished in {self.out}/shards "
                           f"({self.out}/{runs.RUNS} records the failed ones): {again}, once what fails them is fixed "
                           "(a file repaired in place, its row count kept, resumes)")

    def _actor_stats(self, ray) -> None:
        """The actors' statistics for the summary -- which asking them needs the head: where it
        stopped answering as the last shard was written, the job is done and summarized without
        them (``cluster_gone``: the command then exits without Ray's shutdown, which would wait a
        minute for it); with shards failed, the head's loss is the error (_check_cluster)."""
        if not self.failed and not self._head_answers(ray):
            self.actors, self.pg, self.stats["cluster_gone"] = [], None, True  # (nothing to release through it)
            return
        self._check_cluster(ray, actor_died=True)
        self.stats["actors"] = ray.get([a.stats.remote() for slot, a in enumerate(self.actors)
                                        if a is not None and slot not in self.restarts], timeout=30)

    def _fit_memory(self, ray, n: int) -> int:
        """CPU actors with no --memory-per-actor: as many as the nodes' memory holds (reserving Ray's
        memory resource where it binds), each told its share of a node to cap auto's batch by once
        loaded (jobs/footprint.py).  Returns the actors to start."""
        fp = None if self.gpus or self.memory else _footprint(self.spec)
        if fp is None:
            return n
        got = footprint.fit(fp, ray.nodes(), n, self.cpus, self.spec)
        for note in got.notes:
            self.log(note)
        self.memory, self.share = got.reserve, got.share
        return got.actors

    def _feed(self, inflight: dict, pending: deque) -> None:
        """Top up the actors' queues one shard per actor per round, so a short job is spread
        over every actor.  A *suspect* shard (in flight on an actor that failed) runs alone on an
        idle actor, so a failure is charged only to the shard that caused it.  A replacement actor
        gets shards once it is ready (one waiting for a lost node's room held them for minutes)."""
        mine = {slot: [v for v in inflight.values() if v[0] == slot] for slot in range(len(self.actors))}
        progress = True
        while pending and progress:
            progress = False
            for slot, actor in enumerate(self.actors):
                queue = mine[slot]
                full = len(queue) >= self.inflight
                if actor is None or slot in self.restarts or not pending or full or any(v[5] for v in queue):
                    continue
                k, got = pending[0]
                alone = k in self.suspects
                if alone and queue:
                    continue  # wait until this actor drains
                pending.popleft()
                try:
                    rows, kept = got or _read_shard(self.spec, self.plan, k)
                except InputError as e:  # (a damaged file: its shards fail, the rest decode on -- trial AD)
                    self.failed.append(runs.failed_shard(self.plan, k, [], 0, f"cannot read its input rows: {e}"))
                    self.log(f"shard {self.plan.shard(k)[0]} failed: {e}")
                    progress = True
                    continue
                entry = (slot, actor, k, rows, kept, alone)
                backlog = len(pending) * self.plan.shard_size // self.alive  # this actor's share, roughly
                inflight[actor.run_shard.remote(self.plan.shard(k)[0], rows, backlog)] = entry
                queue.append(entry)
                progress = True

    def _loop(self, ray, pending: deque, progress: bool) -> None:
        from ray.exceptions import RayActorError, RayTaskError

        inflight: dict = {}  # ref -> (slot, actor, shard number, rows, kept columns, alone)
        total = sum(self.plan.shard(k)[2] - self.plan.shard(k)[1] for k, _ in pending) * self.plan.samples
        before = self.plan.rows * self.plan.samples - total  # (earlier runs' rows: a resume's progress counts them)
        bar = _progress(total, before) if progress else None
        lines = _LogProgress(total, self.log, before=before) if progress and (bar is None or bar.disable) else None
        plain = self.log
        if bar is not None and not bar.disable:  # (a line said mid-job went onto the bar's: the observability trial)
            self.log = lambda m: _above(bar, plain, m)
        t0 = self.last_done = self.said_at = time.time()
        try:
            while pending or inflight:
                self._feed(inflight, pending)
                for ref in self._wait(ray, inflight, pending):
                    if ref not in inflight:  # its actor's replacement was given up just now: requeued
                        continue
                    slot, actor, k, rows, kept, alone = inflight.pop(ref)
                    try:
                        results = ray.get(ref)
                    except (RayActorError, RayTaskError) as err:
                        # (not the shard's doing; replacements get shards once ready now, so this is a defence)
                        if isinstance(placement.task_cause(err), placement.StartFailed):
                            pending.appendleft((k, (rows, kept)))
                            self._start_failed(ray, slot, actor, err)
                            continue
                        if isinstance(err, RayActorError):
                            self._check_cluster(ray, actor_died=True)
                        lost = placement.node_died(err) or isinstance(err, RayActorError) and self._node_gone(ray, actor)
                        if lost and self.node_losses.get(k, 0) < NODE_LOSSES:
                            self._requeue(k, rows, kept, pending)  # (its node's doing, not the shard's)
                        else:
                            self._retry(k, rows, kept, err, pending, alone)
                        if isinstance(err, RayActorError) and self.actors[slot] is actor:
                            self.stats["actors_lost"] = self.stats.get("actors_lost", 0) + 1  # (the table says it)
                            self.actors[slot] = new = self.start_actor(slot)  # once, in its bundle
                            self.restarts[slot] = (new.ready.remote(), time.time() + self.replace_timeout_s)
                        continue
                    self.suspects.discard(k)
                    write_shard(self.out, self.spec, self.plan, k, _shard_table(self.plan, rows, results, kept),
                                self.stats.get("_run"))
                    self.stats["rows_this_run"] += len(results)
                    self.stats["tokens_this_run"] += sum(r["num_generated_tokens"] or 0 for r in results)
                    self.stats["shards_this_run"] += 1
                    if lines is not None:
                        lines.update(len(results), self.stats["tokens_this_run"])
                    if bar is not None:
                        bar.update(len(results))
                        bar.set_postfix_str(f"{self.stats['tokens_this_run'] / (time.time() - t0):.1f} tok/s "
                                            "since the actors were ready")
        finally:
            self.log = plain
            if bar is not None:
                bar.close()

    def _wait(self, ray, inflight: dict, pending: deque) -> list:
        """Finished shards' refs (at most one); the replacement actors' deadlines, every HEALTH_S
        the head's health (shards go on finishing for a while after it is lost: Ray's client then
        ends the process at 60 s with only its own message) and, every QUIET_S without a finished
        shard, what is in flight are checked."""
        wait_s = RESTART_POLL_S if self.restarts else min(HEALTH_S, QUIET_S)
        if inflight:
            done, _ = ray.wait(list(inflight), num_returns=1, timeout=wait_s)
        else:  # (every actor's replacement still loading: nothing to wait on but them)
            done = []
            time.sleep(wait_s)
        self._check_restarts(ray, inflight, pending)
        now = time.time()
        if now - self.head_checked >= HEALTH_S:
            self.head_checked = now
            self._check_cluster(ray)
        if done:
            self.last_done = now
        else:
            if min(now - self.last_done, now - self.said_at) >= QUIET_S:
                self.said_at = now
                self._say_quiet(inflight, now - self.last_done)
        return done

    def _head_answers(self, ray) -> bool:
        """Whether the cluster's head (its GCS port) accepts a connection now (a ray:// client has
        no GCS address of its own to check: True)."""
        return self._unanswered(ray) is None

    def _unanswered(self, ray) -> tuple[str, OSError] | None:
        """(the head's GCS address, why it did not answer), or None where it answers."""
        try:
            host, _, port = ray.get_runtime_context().gcs_address.rpartition(":")
        except Exception:  # noqa: BLE001 - (a ray:// client has no GCS address of its own to check)
            return None
        e = _unanswered_at(host, int(port))
        return None if e is None else (f"{host}:{port}", e)

    def _check_cluster(self, ray, actor_died: bool = False) -> None:
        """Every HEALTH_S and after an actor death: if the cluster's head is gone, say that (every
        actor "dies" with it, and Ray's client would end the process a minute later with only its
        own message).  A head that does not answer is lost only after HEAD_LOST_S of it (a network
        blip, a busy head); with an actor dead too, at once."""
        lost = self._unanswered(ray)
        if lost is None:
            self.head_down_since = None
            return
        now = time.time()
        self.head_down_since = self.head_down_since or now
        if not actor_died and now - self.head_down_since < HEAD_LOST_S:
            return
        (where, e) = lost
        raise ClusterLost(f"lost the Ray cluster: its head (GCS at {where}) does not answer ({e.strerror or e}); "
                          f"finished shards are kept in {self.out}/shards — restart the head and re-run the same "
                          "command to resume")

    @property
    def alive(self) -> int:
        return sum(a is not None for a in self.actors)

    def _check_restarts(self, ray, inflight: dict, pending: deque) -> None:
        """A replacement actor not ready in time (replace_timeout_s: its node lost, the cluster full) is
        given up: its shards go back to the queue for the others (a dead node's bundle can wait for
        room forever while the other actors sit idle).  One that started is no longer watched; one
        that died before it was ready (started in a lost node's bundle before Ray knew) is started
        again until the deadline; one that failed to load may end the job (_loaded)."""
        for slot, (ref, deadline) in list(self.restarts.items()):
            if ray.wait([ref], timeout=0)[0]:
                del self.restarts[slot]
                self.unplaceable.pop(slot, None)
                self._loaded(ray, slot, ref, deadline)
                continue
            if time.time() <= deadline:
                self._say_unplaceable(ray, slot, deadline)
                continue
            del self.restarts[slot]
            why = f"was not ready after {self.replace_timeout_s:.0f} s ({self._replace_bound()}): " + (
                self.unplaceable.pop(slot, None) or "its node lost, or no room")
            actor, self.actors[slot] = self.actors[slot], None
            for ref_, entry in [(r, e) for r, e in inflight.items() if e[0] == slot]:
                del inflight[ref_]
                pending.appendleft((entry[2], (entry[3], entry[4])))
            ray.kill(actor)
            if not self.alive:
                raise JobError(f"actor {slot}'s replacement {why}, and no other actor is left; finished shards are "
                               f"kept in {self.out}/shards — re-run to resume")
            self.log(f"actor {slot}'s replacement {why}; going on with {self.alive} actor(s)")

    def _replace_bound(self) -> str:
        """Which bound set a replacement's deadline (replace_timeout_s), said for a user."""
        if self.replace_timeout_s >= self.spec.ready_timeout_s:
            return "--ready-timeout-s"
        if self.replace_timeout_s <= REPLACE_MIN_S:
            return f"the least a replacement is given, {REPLACE_MIN_S:g} s"
        return f"{REPLACE_FACTOR:g}x the first actors' start-up"

    def _node_gone(self, ray, actor) -> bool:
        """Whether the node ``actor`` was ready on is gone, asked when the actor died: a raylet that
        dies (SIGKILL, the OOM killer) takes its workers down at once, but Ray says "its node has
        died" only once its head declares the node dead, 15-30 s on -- the shards were charged as
        a crash's (the multi-node trial).  Dead by the head's word, or its raylet's port refusing
        or not answering a connection."""
        node = self.actor_nodes.get(actor)
        if node is None or node in self.gone_nodes:
            return node is not None
        try:
            info = next((n for n in ray.nodes() if n.get("NodeID") == node), None)
        except Exception:  # noqa: BLE001 - (the head itself lost: _check_cluster says so)
            return False
        if info is None:
            return False
        gone = not info.get("Alive", True)
        if not gone:
            try:
                gone = _unanswered_at(info["NodeManagerAddress"], int(info["NodeManagerPort"])) is not None
            except (KeyError, TypeError, ValueError):  # (a node record without its raylet's address: not known)
                pass
        if gone:
            self.gone_nodes.add(node)
        return gone

    def _say_unplaceable(self, ray, slot: int, deadline: float) -> None:
        """Once per waiting replacement: no alive node can hold one now (the only node offering a
        --resource was lost), which a node joining in time would change -- said, where the wait had
        been two minutes of silence and then "its node lost, or no room" (the resource trial)."""
        if slot in self.unplaceable or time.time() < self.next_node_check:
            return
        self.next_node_check = time.time() + 5.0  # (asking the head for its nodes: not every round)
        try:
            placement.check_request(ray.nodes(), 1, self.cpus, self.gpus, self.memory, self.spec.resources_per_actor)
        except placement.PlacementError as e:
            self.unplaceable[slot] = str(e)
            self.log(f"actor {slot}'s replacement waits: {e} -- until a node that can hold it joins, or "
                     f"{max(0, deadline - time.time()):.0f} s more")

    def _loaded(self, ray, slot: int, ready, deadline: float) -> None:
        """A replacement's ready(): loaded (the failures in a row end); lost with its node before it
        was ready (started in a lost node's bundle before Ray knew: another, by the same deadline);
        else failed to load or died loading (an OOM kill: another, up to --max-retries in a row,
        _start_failed)."""
        from ray.exceptions import RayActorError, RayTaskError

        try:
            info = ray.get(ready)
            self.start_failures = 0
            if "node_id" in info:  # (a replacement's node: summary.json's this_run.nodes)
                self.stats.setdefault("nodes", {})[info["node_id"]] = info["node_ip"]
                self.actor_nodes[self.actors[slot]] = info["node_id"]
        except (RayActorError, RayTaskError) as e:
            if isinstance(e, RayActorError):
                self._check_cluster(ray, actor_died=True)  # (with the head gone, every actor "dies")
            if isinstance(e, RayActorError) and placement.node_died(e):
                self.stats["actors_lost"] = self.stats.get("actors_lost", 0) + 1  # (it went uncounted: trial AN)
                self.log(f"actor {slot}'s replacement was lost with its node before it was ready; starting another")
                self.actors[slot] = new = self.start_actor(slot)
                self.restarts[slot] = (new.ready.remote(), deadline)
            else:
                self._start_failed(ray, slot, self.actors[slot], e)

    def _start_failed(self, ray, slot: int, actor, err) -> None:
        """Models damaged or moved since the job began fail every replacement's load: each shard was
        retried through such start-ups (~100 in 11 min for 26 shards) and then called failed (the
        faults trial).  Another is started for a failure that may pass (a GPU not yet freed, a node's
        full disk), and after --max-retries in a row the job ends with the load's error."""
        if self.actors[slot] is not actor:
            return  # (said already, by its ready() or another of its shards)
        self.start_failures += 1
        why = placement.describe_error(err).removeprefix("StartFailed: ")
        if self.start_failures > self.spec.max_retries:
            raise JobError(f"actor {slot}'s replacement failed to start {self.start_failures} times in a row: {why} "
                           f"(what it loads changed since the job began?); finished shards are kept in "
                           f"{self.out}/shards, and once fixed the same command resumes")
        self.log(f"actor {slot}'s replacement failed to start ({why}); starting another "
                 f"({self.start_failures}/{self.spec.max_retries})")
        ray.kill(actor)
        self.actors[slot] = new = self.start_actor(slot)
        self.restarts[slot] = (new.ready.remote(), time.time() + self.replace_timeout_s)

    def _say_quiet(self, inflight: dict, quiet_s: float) -> None:
        """No shard finished for a while: say what is in flight where (a hung actor must not look
        like a slow one for hours; a long shard may just be long)."""
        where = ", ".join(f"{self.plan.shard(k)[0]} ({len(rows)} rows) on actor {slot}"
                          for slot, _, k, rows, _, _ in sorted(inflight.values(), key=lambda v: (v[0], v[2])))
        self.log(f"no shard finished in the last {quiet_s / 60:.0f} min; in flight: {where} "
                 f"(each row decodes up to --max-new-tokens {self.spec.max_new_tokens}; if this repeats with "
                 "no progress, the actors' logs say why)")

    def _requeue(self, k: int, rows, kept, pending: deque) -> None:
        """A shard whose actor was lost with its node goes back to the queue as any other (not
        alone, no attempt charged): a lost machine says nothing about the shards it held (up to
        NODE_LOSSES times a shard: one that keeps taking nodes down is retried as a suspect)."""
        self.stats["retries"] += 1
        self.node_losses[k] = self.node_losses.get(k, 0) + 1
        self.log(f"shard {self.plan.shard(k)[0]}'s actor was lost with its node; requeued")
        pending.appendleft((k, (rows, kept)))

    def _retry(self, k: int, rows, kept, err, pending: deque, alone: bool) -> None:
        """A failed shard goes back to the front of the queue; only a failure while it ran alone
        counts as an attempt (in a shared batch, any shard in flight may have caused it)."""
        from ray.exceptions import RayActorError

        name = self.plan.shard(k)[0]
        self.stats["retries"] += 1
        self.suspects.add(k)
        self.attempts[k] = self.attempts.get(k, 0) + alone
        # (a node lost moments ago reads as this too: Ray says "its node has died" only once its head
        # has declared the node dead, ~15 s on, and such a shard is then requeued: _requeue)
        why = "its actor died: a crash, or its node lost" if isinstance(err, RayActorError) else "task error"
        if self.attempts[k] > self.spec.max_retries:
            self.failed.append(runs.failed_shard(self.plan, k, rows, self.attempts[k], placement.describe_error(err)))
            times = "once" if self.attempts[k] == 1 else f"{self.attempts[k]} times"
            self.log(f"shard {name} failed {times}; giving up: {placement.describe_error(err)}")
            return
        self.log(f"shard {name} failed ({why}); " + (f"retry {self.attempts[k]}/{self.spec.max_retries}" if alone
                                                     else "retrying it alone"))
        pending.appendleft((k, (rows, kept)))
