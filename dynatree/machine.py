"""What a measurement ran on: the CPU as `lscpu` names it, and how fast its FMAs ran at the time.

Why: the same code measures up to ~2x apart on two CPUs of one cloud's "2 vCPU" size, and on one
VM over an afternoon (two vCPUs that sometimes share a physical core); a table of tokens/s means
little without the CPU it came from and the FMA rate it had then.  (Also: whether a directory
here can take what a command will write, before it works for hours, and writing a file whole or
not at all.)
"""
from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path

FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "asimd", "sve")  # what the kernels use


def env_on(name: str) -> bool:
    """A switch read from the environment, on unless set to 0, false, off or no (any case): a
    value such as ``false`` was ignored where only ``0`` turned it off (trial AM); a value none of
    those nor 1, true, on, yes is said once, and leaves it on."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("0", "false", "off", "no"):
        return False
    if value not in ("", "1", "true", "on", "yes"):
        import warnings

        warnings.warn(f"{name}={os.environ[name]!r} is not 0/1 (false/true, off/on, no/yes): read as on",
                      stacklevel=2)
    return True


def usable_cpus() -> int:
    """The logical CPUs this process may run on (taskset, cgroup cpusets), or the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu() -> dict:
    """The CPU's identity: model name, vendor, family/model (x86), the SIMD flags the kernels care
    about, logical CPUs this process may use.  Fields unknown on this OS are left out."""
    from .kbuild import cpuinfo_lines

    info = {"arch": platform.machine(), "cpus": usable_cpus()}
    first = {k: line.partition(":")[2].strip() for k, line in cpuinfo_lines().items()}
    if not first:
        return {**info, "model": platform.processor() or "unknown"}
    names = {"model": "model name", "vendor": "vendor_id", "family": "cpu family", "model_number": "model"}
    info.update({k: first[v] for k, v in names.items() if v in first})
    if "model" not in info:  # aarch64 kernels name the implementer and part instead
        info["model"] = " ".join(f"{k} {first[k]}" for k in ("CPU implementer", "CPU part") if k in first) or "unknown"
    have = set((first.get("flags") or first.get("Features") or "").split())
    info["flags"] = [f for f in FLAGS if f in have]
    return info


def fma_rates(threads: int) -> dict | None:
    """The native kernel's FMA probe (native.fma_peak) on ``threads`` threads and on one, in
    GFLOP/s, or None without the kernel.  A rate on N threads far under N times one thread's
    means the CPUs share cores (SMT siblings, or another tenant's load on them): shares_cores."""
    from . import native

    n = min(threads, usable_cpus())  # (64 threads on 2 CPUs read 3.71x one thread's rate: no machine's peak)
    many = native.fma_peak(n)
    if not many:
        return None
    one = many if n == 1 else native.fma_peak(1)
    out = {"variant": native.variant(), "threads": n, "gflops": round(many, 1), "one_thread_gflops": round(one, 1)}
    return out if n == threads else {**out, "run_threads": threads}


def shares_cores(rates: dict) -> bool:
    return rates["threads"] > 1 and rates["gflops"] < 0.75 * rates["threads"] * rates["one_thread_gflops"]


def describe(info: dict) -> str:
    """One line: 'Intel(R) Xeon(R) Processor (x86_64, family 6 model 207; avx2 fma avx512f), 2 CPUs'."""
    x86 = f", family {info['family']} model {info['model_number']}" if "family" in info else ""
    flags = f"; {' '.join(info['flags'])}" if info.get("flags") else ""
    return f"{info.get('model', 'unknown')} ({info.get('arch', '?')}{x86}{flags}), {info.get('cpus', '?')} CPUs"


def describe_rates(rates: dict) -> str:
    one = f" ({rates['gflops'] / rates['one_thread_gflops']:.2f}x one thread's {rates['one_thread_gflops']:.1f})" \
        if rates["threads"] > 1 else ""
    over = f" (the run's {rates['run_threads']} threads exceed the CPUs)" if "run_threads" in rates else ""
    return f"{rates['gflops']:.1f} GFLOP/s on {rates['threads']} thread{'s' * (rates['threads'] > 1)}{one}{over}"


def busy_cpus(seconds: float = 0.25) -> float | None:
    """CPUs' worth of time other processes kept this machine busy over the next ``seconds`` (from
    /proc/stat, less this process's own CPU time: it may load models meanwhile), or None where
    there is no /proc/stat.  Why: a forward on N threads waits at every step for a thread another
    process displaced -- with both of 2 cores busy elsewhere a 2-thread `generate` ran up to ~300x
    slower in a user's trial, one thread not at all.  (A quarter second: over 50 ms, a process
    using 0.3 CPU in bursts read above 0.5 in 28 of 100 samples.)"""
    import time

    try:
        before = cpu_snapshot()
        time.sleep(seconds)
        return busy_between(before, cpu_snapshot())
    except (OSError, ValueError, IndexError):
        return None


def cpu_snapshot() -> tuple[float, float, float]:
    """(monotonic seconds, CPU-seconds the machine has been busy since boot, this process's
    CPU-seconds -- its threads' and its finished children's, a kernel build's)."""
    import time

    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    t = os.times()
    return (time.monotonic(), (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK"),
            t.user + t.system + t.children_user + t.children_system)


def busy_between(a: tuple[float, float, float], b: tuple[float, float, float]) -> float | None:
    """CPUs other processes kept busy between two cpu_snapshot()s (None if no time passed)."""
    wall = b[0] - a[0]
    return max(0.0, (b[1] - a[1]) - (b[2] - a[2])) / wall if wall > 0 else None


PROBE = ".write-probe-0000000000.parquet.tmp"  # as long as any name written beside it (a shard's temporary file:
# a path near PATH_MAX passed a shorter probe, then failed at the first shard, the models loaded: trial AK)


def ensure_writable(directory: Path, room: int = 0) -> None:
    """Make ``directory`` and write ``room`` bytes (at least one) into a probe file there, removed
    again whatever happens (a failed probe on a full disk had left an empty one); OSError if it
    cannot be made or take them."""
    probe = directory / PROBE
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"\0" * max(room, 1))
            if room:  # (a megabyte the filesystem accepted into its cache may still not fit on disk)
                f.flush()
                os.fsync(f.fileno())
    finally:
        with contextlib.suppress(OSError):  # (none made: a path through a file, a full disk)
            probe.unlink()


@contextlib.contextmanager
def replaced(path: Path, tmp: Path | None = None):
    """A temporary path (``tmp``, default ``path`` with suffix .tmp) to write ``path``'s new
    contents into: renamed over ``path`` once written, so a reader never sees half a file, and
    removed if writing fails (a full disk had left an empty one beside the output).  An OSError
    names ``path`` (pyarrow's "[Errno 28] Error writing bytes to file" named no file)."""
    tmp = tmp or path.with_suffix(".tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):  # (none made: the write failed to open it)
            tmp.unlink()
        if isinstance(e, OSError) and str(path) not in str(e):  # (OSError(errno, ...) is errno's subclass again)
            said = f"cannot write {path}: {e.strerror or e}"
            raise (OSError(e.errno, said) if e.errno is not None else OSError(said)) from e
        raise


def versions() -> dict:
    """The versions a result came from: Python's, the packages', and the checkout's commit where
    dynatree runs from a git checkout (its version number alone names no change)."""
    import subprocess
    from importlib import metadata

    out = {"python": platform.python_version()}
    for pkg in ("dynatree", "torch", "transformers", "ray", "pyarrow", "tokenizers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    root = Path(__file__).resolve().parent.parent
    if (root / ".git").exists():
        try:
            def git(*args) -> str:  # (no optional locks: a `git commit` beside it must not fail on index.lock)
                done = subprocess.run(["git", "--no-optional-locks", "-C", str(root), *args], capture_output=True,
                                      text=True, timeout=10, check=True)
                return done.stdout.strip()

            out["commit"] = git("rev-parse", "HEAD") + ("+changes" if git("status", "--porcelain", "-uno") else "")
        except (OSError, subprocess.SubprocessError):  # (no git, or it refuses the checkout: no commit said)
            pass
    return out
