"""Building csrc/ into the shared object native.py loads (no torch needed here).

The object is cached under ``$DYNATREE_CACHE`` (default ``~/.cache/dynatree``), keyed by the
sources, the compiler, the variant's flags and the CPU's feature flags; a lock file makes
concurrent builders of the same object (several actors on one machine) wait for one build instead
of each compiling it on the same cores.
"""
from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import functools
import hashlib
import os
import platform
import shlex
import shutil
import signal
import stat
import struct
import subprocess
import tempfile
import time
from pathlib import Path

from .machine import env_on, replaced

_CSRC = Path(__file__).with_name("csrc")
SOURCES = [_CSRC / name for name in ("gemm.c", "attn.c", "neox.c")]
HEADERS = [_CSRC / "vec.h", _CSRC / "attn.h", _CSRC / "neox.h"]
# the objects of a build, compiled side by side: (source, extra flags); attn.c twice, for float32
# and bfloat16 caches
OBJECTS = [(_CSRC / "gemm.c", []), (_CSRC / "attn.c", []), (_CSRC / "attn.c", ["-DDT_KV_BF16"]),
           (_CSRC / "neox.c", [])]
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]
_X86 = platform.machine().lower() in ("x86_64", "amd64")
VARIANTS = {  # DYNATREE_ISA -> the flags that select it (csrc/vec.h picks the blocking from them)
    "native": ["-march=native"] + (["-mprefer-vector-width=512"] if _X86 else []),
    "avx2": ["-march=x86-64-v3"],
    "generic": ["-march=native", "-DDT_GENERIC"],
}
def cpuinfo_lines() -> dict[str, str]:
    """Each /proc/cpuinfo key's first line, whole ({} where there is no such file)."""
    lines: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, sep, _ = line.partition(":")
            if sep:
                lines.setdefault(key.strip(), line)
    except OSError:
        pass
    return lines


def cpuinfo(*keys: str) -> str:
    """The first /proc/cpuinfo line of one of ``keys``, whole (platform.processor() without one)."""
    lines = cpuinfo_lines()
    return next((lines[k] for k in keys if k in lines), None) or platform.processor()


def cpu_flags() -> str:
    """The CPU's feature flags line (the variants it runs, part of the build's cache key)."""
    return cpuinfo("flags", "Features")


def cache_dir() -> Path:
    """Where built kernels and budget profiles are kept: ``$DYNATREE_CACHE`` (set and not empty, a
    leading ~ expanded: systemd's and Ray's env_vars do not), else ~/.cache/dynatree, else -- no home
    directory: a container's user with no passwd entry and no HOME crashed every command -- a
    directory of this user's in the temporary directory."""
    named = os.environ.get("DYNATREE_CACHE", "")
    try:
        return Path(named).expanduser() if named else Path.home() / ".cache" / "dynatree"
    except RuntimeError:  # ("Could not determine home directory"; "~/x" too, which had made ./~/x)
        return _private_tmp()


def _private_tmp() -> Path:
    """dynatree-<uid> in the temporary directory, made this user's alone: objects loaded from a
    directory another user could write would run their code."""
    path = Path(tempfile.gettempdir()) / f"dynatree-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        st = path.lstat()
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022:
            return path
    except OSError:
        pass
    return _process_tmp()  # (someone else's, or not a directory: this process's own, kept for its life)


@functools.cache
def _process_tmp() -> Path:
    path = Path(tempfile.mkdtemp(prefix="dynatree-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)  # (this process's alone: nothing to keep)
    return path


def cache_said() -> str:
    """The cache directory as a message names where it came from."""
    return "DYNATREE_CACHE" if os.environ.get("DYNATREE_CACHE") else "the default cache; DYNATREE_CACHE names another"


def variant() -> str:
    """The kernel variant this process asks for: ``$DYNATREE_ISA`` (default ``native``)."""
    return os.environ.get("DYNATREE_ISA") or "native"  # (set but empty: unset, as for most knobs)


def variants_here() -> list[str]:
    """The variants this CPU can run (``avx2`` needs an x86 CPU with AVX2 and FMA)."""
    flags = cpu_flags().split()
    return ["native"] + (["avx2"] if _X86 and {"avx2", "fma"} <= set(flags) else []) + ["generic"]


def has_avx512() -> bool:
    """Whether this CPU runs AVX-512 (torch's MKL then does, whatever variant the kernel is built as)."""
    return _X86 and "avx512f" in cpu_flags().split()


def source_hash() -> str:
    """A digest of the kernel's C sources: part of every cache key that depends on what they compute."""
    return hashlib.sha256("\0".join(src.read_text() for src in SOURCES + HEADERS).encode()).hexdigest()[:16]


COMPILE_TIMEOUT_S = 600  # a build takes 10-40 s


def _compile(cc: list[str], flags: list[str], out: str) -> str | None:
    """Compile the objects side by side (one compiler each: the first job on a machine waits for
    the build) and link them into ``out``; the compiler's errors, or None."""
    # (the objects beside the cache and -pipe, no assembler files in $TMPDIR: a build writes only where
    # DYNATREE_CACHE is, and a full /tmp cannot fail it with "No usable temporary directory")
    with tempfile.TemporaryDirectory(dir=Path(out).parent, prefix="build-") as work:
        objs = [str(Path(work) / f"{i}-{src.stem}.o") for i, (src, _) in enumerate(OBJECTS)]
        # (each compiler in its own process group, ended with it below: a killed driver left cc1 running)
        procs = [subprocess.Popen([*cc, "-pipe", *flags, *extra, "-c", str(src), "-o", obj], stderr=subprocess.PIPE, text=True,
                                  start_new_session=True) for (src, extra), obj in zip(OBJECTS, objs)]
        try:  # (a hung compiler would hold the build lock every other process waits on)
            errors = [p.communicate(timeout=COMPILE_TIMEOUT_S)[1] for p in procs]
            if any(p.returncode for p in procs):
                return "".join(errors).strip() or f"exit status {[p.returncode for p in procs]}"
            procs.append(subprocess.Popen([*cc, "-pipe", *flags, *objs, "-o", out, "-lm"], stderr=subprocess.PIPE, text=True,
                                          start_new_session=True))
            error = procs[-1].communicate(timeout=COMPILE_TIMEOUT_S)[1]
        except subprocess.TimeoutExpired:
            return f"no result after {COMPILE_TIMEOUT_S} s"
        finally:  # (an interrupt or a timeout: no compiler outlives the build)
            for p in procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        return (error.strip() or f"link: exit status {procs[-1].returncode}") if procs[-1].returncode else None


def build(isa: str | None = None) -> tuple[Path | None, str]:
    """The built object of variant ``isa`` (default: variant()): (path, "") or (None, why not)."""
    if not env_on("DYNATREE_GEMM"):
        return None, f"disabled by DYNATREE_GEMM={os.environ['DYNATREE_GEMM']}"
    isa = isa or variant()
    if isa not in VARIANTS:
        return None, f"unknown DYNATREE_ISA={isa!r} (one of {', '.join(VARIANTS)})"
    if isa not in variants_here():
        return None, f"DYNATREE_ISA={isa} cannot run on this CPU ({platform.machine()})"
    # DYNATREE_CFLAGS: extra flags, e.g. a sanitizer build (README, Tests); part of the cache key
    flags = FLAGS + VARIANTS[isa] + os.environ.get("DYNATREE_CFLAGS", "").split()
    named = os.environ.get("CC") or "cc"
    try:  # (a command with words, as make and setuptools take it: CC="ccache gcc")
        cc = shlex.split(named)
    except ValueError as e:
        return None, f"CC={named!r} is not a command: {e}"
    if not cc or shutil.which(cc[0]) is None:
        return None, f"no C compiler ({cc[0] if cc else named!r} not on PATH)"
    try:
        version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{named} --version failed: {e}"
    parts = [source_hash(), version, " ".join(flags), platform.machine(), cpu_flags()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    cache = cache_dir()
    lib_path = cache / f"libdtgemm-{key}.so"
    if lib_path.exists() and _whole(lib_path):
        return lib_path, ""
    try:
        return _build_into(cache, key, cc, flags)
    except OSError as e:  # (an unwritable or misplaced DYNATREE_CACHE)
        what = "a file, not a directory" if e.errno in (errno.EEXIST, errno.ENOTDIR) else e.strerror or e
        return None, f"cannot build in {cache} ({cache_said()}): {what}"


def _digest_path(lib: Path) -> Path:
    return lib.with_name(lib.name + ".sha256")


def _whole(lib: Path) -> bool:
    """Whether a cached object is the one its build wrote: the digest kept beside it matches (one an
    older version built, or a copy without its digest, has none: then its ELF section headers must
    lie inside it).  A truncated copy -- a cache copied or shared over a network filesystem --
    crashed every process that loaded it with a bus error."""
    try:
        want = _digest_path(lib).read_text().strip()
    except FileNotFoundError:
        return _elf_whole(lib)
    except OSError:
        return False
    try:
        return hashlib.sha256(lib.read_bytes()).hexdigest() == want
    except OSError:
        return False


def _elf_whole(lib: Path) -> bool:
    """An ELF shared object that holds all of its section header table (its last part: what a
    truncated copy loses first)."""
    try:
        with open(lib, "rb") as f:
            head, size = f.read(64), os.fstat(f.fileno()).st_size
    except OSError:
        return False
    if len(head) < 52 or head[:4] != b"\x7fELF" or head[4] not in (1, 2) or head[5] not in (1, 2):
        return False
    order = "<" if head[5] == 1 else ">"
    if head[4] == 2 and len(head) < 64:
        return False
    at, fmt = (0x28, "Q") if head[4] == 2 else (0x20, "I")  # e_shoff; then e_shentsize, e_shnum
    shoff = struct.unpack_from(order + fmt, head, at)[0]
    entsize, count = struct.unpack_from(order + "HH", head, 0x3A if head[4] == 2 else 0x2E)
    return shoff + entsize * count <= size


def _write_digest(lib: Path, digest: str) -> None:
    with replaced(_digest_path(lib)) as tmp:
        tmp.write_text(digest + "\n")


def _umask() -> int:
    """The process's umask, read without setting it where Linux shows it (os.umask sets it: a file
    another thread created in between would get none)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        umask = os.umask(0o022)
        os.umask(umask)
        return umask


def _clear_stale_builds(cache: Path) -> None:
    """The objects' directories of builds killed outright (SIGKILL: no finally ran), once older
    than any build may take; a live build's, of another object, is younger."""
    for old in cache.glob("build-*"):  # (objects, and the linked object mkstemp made: a SIGKILL leaves both)
        with contextlib.suppress(OSError):
            if time.time() - old.stat().st_mtime > 2 * COMPILE_TIMEOUT_S:
                shutil.rmtree(old) if old.is_dir() else old.unlink()


def _build_into(cache: Path, key: str, cc: list[str], flags: list[str]) -> tuple[Path | None, str]:
    lib_path = cache / f"libdtgemm-{key}.so"
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"libdtgemm-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another builder of this object: wait for its result
        _clear_stale_builds(cache)
        if not (lib_path.exists() and _whole(lib_path)):  # (a damaged copy is built again)
            # build beside the target and rename: a reader never sees a half-written object
            fd, tmp = tempfile.mkstemp(prefix="build-", suffix=".so", dir=cache)
            os.close(fd)
            try:
                error = _compile(cc, flags, tmp)
                if error:
                    return None, f"{shlex.join(cc)} failed: {error[:500]}"
                os.chmod(tmp, 0o755 & ~_umask())  # (mkstemp's file is private: another user's jobs could not load it)
                digest = hashlib.sha256(Path(tmp).read_bytes()).hexdigest()
                os.replace(tmp, lib_path)
                _write_digest(lib_path, digest)
            finally:  # (a failed or interrupted build leaves nothing in the cache)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
    return lib_path, ""

