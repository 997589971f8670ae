"""The native kernel built for other CPUs and by another compiler computes the same bits as this
host's builds (vec.h's promise, so a corpus decoded on a Graviton node, or by a clang build, is
the same corpus).  tests/kernel_bits.c writes every result of the kernel on fixed inputs -- GEMMs
in each weight format, whole NeoX- and Llama-shaped forwards over float32 and bfloat16 caches with
trees, shared prefixes and every head, sampling noise -- to a file; the files must be equal byte
for byte.  aarch64 builds are cross-compiled and run under qemu-user (gcc-aarch64-linux-gnu,
qemu-user), clang builds natively (clang, libomp-dev); .ci/run installs them where apt-get can,
and without them these tests skip, saying so."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from dynatree import kbuild

HARNESS = Path(__file__).with_name("kernel_bits.c")
CROSS, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
SYSROOT = "/usr/aarch64-linux-gnu"  # Debian's cross toolchain: the aarch64 libc, libm, libgomp qemu loads
GEMM_BYTES = 3 * (sum(range(1, 28)) + 1 + 13 + 25) * 80 * 4  # kernel_bits.c's GEMMs: 3 formats x their rows x 80 floats

needs_arm = pytest.mark.skipif(shutil.which(CROSS) is None or shutil.which(QEMU) is None,
                               reason=f"needs {CROSS} and {QEMU} (Debian: apt-get install gcc-aarch64-linux-gnu qemu-user)")


def _bits(cc: str, lib: Path, work: Path, tag: str, run: list[str], threads: int = 2) -> bytes:
    """kernel_bits.c linked against kernel library ``lib`` with ``cc``, run (through ``run``, e.g.
    qemu) on ``threads`` threads; its output file."""
    exe, out = work / f"bits-{tag}", work / f"bits-{tag}.bin"
    subprocess.run([cc, "-O1", "-o", str(exe), str(HARNESS), str(lib), f"-Wl,-rpath,{lib.parent}"], check=True,
                   capture_output=True, text=True, timeout=300)
    done = subprocess.run([*run, str(exe), str(out), str(threads)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return out.read_bytes()


def _first_difference(a: bytes, b: bytes) -> str:
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return (f"{len(a)} vs {len(b)} bytes, first difference at byte {at} "
            f"({'in the GEMMs' if at < GEMM_BYTES else 'in the forwards or heads, after the GEMMs'})")


def _builds_with_gcc() -> bool:
    """Whether kbuild's builds are GCC's with its plain flags ($CC, cc by default; no DYNATREE_CFLAGS)."""
    cc = os.environ.get("CC", "cc")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout if shutil.which(cc) else ""
    return "Free Software Foundation" in version and not os.environ.get("DYNATREE_CFLAGS")


@pytest.fixture(scope="module")
def x86_bits(tmp_path_factory) -> dict[str, bytes]:
    """kernel_bits.c's output from GCC's build of each variant this host runs (native, avx2,
    generic) with kbuild's flags -- GCC's whatever $CC says, so the clang test compares two compilers."""
    if shutil.which("gcc") is None:
        pytest.skip("no gcc: the reference builds are GCC's")
    work = tmp_path_factory.mktemp("x86")
    bits = {}
    for isa in kbuild.variants_here():
        if _builds_with_gcc():
            lib, status = kbuild.build(isa)  # the product's own build, cached for the other kernel tests
            assert lib is not None, status
        else:
            lib = work / f"libdt-gcc-{isa}.so"
            error = kbuild._compile(["gcc"], kbuild.FLAGS + kbuild.VARIANTS[isa], str(lib))
            assert error is None, error
        bits[isa] = _bits("gcc", lib, work, isa, [])
    return bits


@needs_arm
@pytest.mark.parametrize("march,cpu,extra", [("armv8-a", None, []), ("armv8-a", None, ["-DDT_GENERIC"]),
                                             ("armv9-a", "max", [])],
                         ids=["armv8", "armv8-generic", "armv9-sve2"])
def test_aarch64_builds_compute_the_bits_of_every_x86_build(tmp_path, x86_bits, march, cpu, extra):
    """armv8-a is every 64-bit ARM CPU; armv9-a lets GCC vectorise with SVE2 (Graviton 4), what
    -march=native picks there (armv8.2-a+fp16, Graviton 2, was checked alike once: 2026-11-29);
    -DDT_GENERIC is the `generic` variant there (no NEON intrinsics)."""
    lib = tmp_path / "libdt-aarch64.so"
    error = kbuild._compile([CROSS], kbuild.FLAGS + [f"-march={march}", *extra], str(lib))  # the objects a build links
    assert error is None, error
    arm = _bits(CROSS, lib, tmp_path, "arm", [QEMU, "-L", SYSROOT] + (["-cpu", cpu] if cpu else []), threads=3)
    assert len(arm) > GEMM_BYTES
    for isa, x86 in x86_bits.items():
        assert x86 == arm, f"{isa} build against aarch64 -march={march}: {_first_difference(x86, arm)}"


def _clang_openmp(work: Path) -> str:
    """Why clang cannot build OpenMP code here ("" when it can)."""
    if shutil.which("clang") is None:
        return "no clang (Debian: apt-get install clang libomp-dev)"
    src = work / "omp.c"
    src.write_text("#include <omp.h>\nint main(void) { return omp_get_max_threads() < 1; }\n")
    done = subprocess.run(["clang", "-fopenmp", str(src), "-o", str(work / "omp")], capture_output=True, text=True)
    return f"clang -fopenmp fails (libomp-dev?): {done.stderr.strip()[:200]}" if done.returncode else ""


@pytest.mark.parametrize("isa", kbuild.variants_here())
def test_clang_builds_compute_the_bits_of_the_gcc_builds(tmp_path, x86_bits, isa):
    """`CC=clang` builds each variant (kbuild's flags) and computes what GCC's build computes:
    clang contracts a*b+c only within a statement and ignores GCC's optimize attribute, which
    the unfused code (DT_UNFUSED) is written for."""
    why = _clang_openmp(tmp_path)
    if why:
        pytest.skip(why)
    lib = tmp_path / f"libdt-clang-{isa}.so"
    error = kbuild._compile(["clang"], kbuild.FLAGS + kbuild.VARIANTS[isa], str(lib))
    assert error is None, error
    got = _bits("clang", lib, tmp_path, f"clang-{isa}", [], threads=1)
    assert got == x86_bits[isa], f"clang's {isa} build against GCC's: {_first_difference(x86_bits[isa], got)}"


def test_an_avx512f_build_without_avx512bw_computes_the_bits_of_the_native_build(tmp_path, x86_bits):
    """vec.h's AVX-512 code widens bfloat16 pairs with 512-bit 16-bit unpacks (AVX512BW) where the
    CPU has them, and with 256-bit halves on AVX-512F alone (Knights Landing): the second path,
    built here with -mno-avx512bw on a CPU that runs both, computes the same bits."""
    flags = kbuild.cpuinfo("flags").split()
    if "avx512f" not in flags or "avx512bw" not in flags:
        pytest.skip("needs a CPU with AVX512F and AVX512BW (to run the build without BW beside the native one)")
    lib = tmp_path / "libdt-gcc-nobw.so"
    error = kbuild._compile(["gcc"], kbuild.FLAGS + kbuild.VARIANTS["native"] + ["-mno-avx512bw"], str(lib))
    assert error is None, error
    got = _bits("gcc", lib, tmp_path, "nobw", [])
    assert got == x86_bits["native"], f"the build without AVX512BW: {_first_difference(x86_bits['native'], got)}"
