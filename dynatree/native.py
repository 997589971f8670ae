"""The CPU kernels of ``csrc/``: built on first use with the machine's C compiler, loaded with
ctypes, used by cmodel.py (the whole forward of GPT-NeoX and Llama-family models), runtime and
sampling (argmax, top-k, Gumbel noise) and kvcache (keep) for float32 CPU tensors.

Why a kernel of our own: on a CPU the verify forward of a small model is a stream over its
weights.  A tree of 16 tokens should cost what one token costs, but MKL and oneDNN pay 1.5-2x
for 16 rows (measured on this project's host; ``dynatree profile`` prints the table).  The
kernel reads each packed weight tile once per 12 rows and is *batch invariant*: a row's output
is bitwise the same whatever else is in the batch.  ``csrc/neox.c`` builds a whole decoder
forward on it whose attention is batch invariant too, so a tree verification scores each node
exactly as an AR step would.

Weights are packed once at load.  When every weight of a model is exactly representable in
bfloat16 or IEEE half (a bf16 or fp16 checkpoint loaded as float32 — the bench pair, Pythia's
fp16 release), the packed copy is stored in that 16-bit format and widened in registers: half
the bytes to stream, bitwise the same float32 arithmetic (``weight_format``;
``DYNATREE_WEIGHTS16=0`` keeps float32).

**Variants** (``DYNATREE_ISA``): ``native`` (default; ``-march=native``, the blocking of the
instruction set found: AVX-512, AVX2 + FMA, NEON or plain 128-bit vectors — see csrc/vec.h),
``avx2`` (``-march=x86-64-v3``: what an AVX2-only x86 CPU runs, buildable and testable on an
AVX-512 host) and ``generic`` (portable 128-bit GCC vectors, no intrinsics: the code ARM -- with
one NEON intrinsic, as ``neon`` -- and other CPUs compile).  Every variant computes the same bits
where the CPU fuses multiply-adds, aarch64 builds included (tests/test_kernel_portable.py, qemu-user).

kbuild.py builds and caches the shared object.  No compiler, a failed build or ``DYNATREE_GEMM=0`` -> ``library()`` returns None and
callers keep torch's kernels; ``status()`` says why.
"""
from __future__ import annotations

import ctypes
import os
import sys
import weakref

import torch

from .config import MAX_PACKED_BYTES  # noqa: F401 (cmodel reads it here; tests change it)
from .kbuild import VARIANTS, build, source_hash, variant, variants_here  # noqa: F401 (this module's API)
from .machine import env_on


_libs: dict[str, tuple[ctypes.CDLL | None, str]] = {}  # variant -> (library or None, status)


class DtSeq(ctypes.Structure):
    """csrc/neox.h's dt_seq: one sequence's part of a packed forward (sizes checked in _build)."""

    _fields_ = [("rows", ctypes.c_long), ("past", ctypes.c_long), ("visible", ctypes.c_long), ("cap", ctypes.c_long),
                ("keep", ctypes.c_long), ("allowed", ctypes.c_void_p), ("kc", ctypes.c_void_p), ("vc", ctypes.c_void_p),
                ("kvfmt", ctypes.c_long), ("noise", ctypes.c_void_p), ("inv_temp", ctypes.c_float),
                ("nshare", ctypes.c_long), ("ends", ctypes.c_void_p), ("ks", ctypes.c_void_p), ("vs", ctypes.c_void_p),
                ("scaps", ctypes.c_void_p)]

MAX_PIECES = 16  # csrc/attn.h DT_MAX_PIECES: the most pieces a shared prefix is read in

KV_FORMATS = {torch.float32: 0, torch.bfloat16: 1}  # cache element types the kernel reads (dt_seq.kvfmt)


def _build(isa: str | None = None) -> tuple[ctypes.CDLL | None, str]:
    lib_path, why = build(isa)
    if lib_path is None:
        return None, why
    lib = ctypes.CDLL(str(lib_path))
    P, L, F, I = ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_int
    lib.dt_gemm.argtypes = [P, L, L, P, I, P, P, L, I]
    lib.dt_gemm.restype = None
    lib.dt_neox_forward.argtypes = [P, F, F, L, P, P, P, P, L, P, P, P, P, L, P, P, I, L, L, P, P]
    lib.dt_softmax_topk.argtypes = [P, L, L, L, L, P, P]
    lib.dt_softmax_topk.restype = None
    lib.dt_argmax.argtypes = [P, L, L, L, P]
    lib.dt_gumbel.argtypes = [ctypes.c_uint, ctypes.c_uint, L, P]
    lib.dt_gumbel.restype = None
    lib.dt_argmax.restype = None
    lib.dt_attn_supported.argtypes = [L]
    lib.dt_cache_keep.argtypes = [P, P, L, L, L, L, L, P, L, L]
    lib.dt_cache_keep.restype = None
    lib.dt_neox_forward.restype = ctypes.c_int
    lib.dt_work_per_row.argtypes = [P]
    lib.dt_work_per_row.restype = L
    lib.dt_isa.restype = ctypes.c_char_p
    lib.dt_fma_peak.restype = ctypes.c_double
    lib.dt_fma_peak.argtypes = lib.dt_dot_peak.argtypes = [L, I]
    lib.dt_dot_peak.restype = ctypes.c_double
    lib.dt_isa.argtypes = lib.dt_vector_floats.argtypes = lib.dt_rows_per_pass.argtypes = lib.dt_tile_width.argtypes = []
    lib.dt_bf16_dot.argtypes, lib.dt_bf16_dot.restype = [], ctypes.c_int
    lib.dt_seq_bytes.argtypes, lib.dt_seq_bytes.restype = [], L
    if lib.dt_seq_bytes() != ctypes.sizeof(DtSeq):  # (a field added on one side only: every forward would misread)
        return None, f"csrc/neox.h's dt_seq is {lib.dt_seq_bytes()} bytes, native.DtSeq {ctypes.sizeof(DtSeq)}"
    return lib, f"{isa or variant()} variant: {describe(lib)}, {lib_path}"


def describe(lib: ctypes.CDLL) -> str:
    """What a built kernel runs: its instruction set and register blocking."""
    return (f"{lib.dt_isa().decode()} code, {lib.dt_vector_floats()}-float vectors, "
            f"GEMM passes of {lib.dt_rows_per_pass()} rows x {lib.dt_tile_width()} columns")


def fma_peak(threads: int, isa: str | None = None) -> float:
    """GFLOP/s of independent FMA chains at this variant's vector width on ``threads`` threads
    (best of three ~50 ms runs): the ceiling the GEMM's achieved GFLOP/s compare with."""
    lib = library(isa)
    return max(lib.dt_fma_peak(20_000_000 // lib.dt_vector_floats(), threads) for _ in range(3)) if lib else 0.0


def dot_peak(threads: int, isa: str | None = None) -> float:
    """fma_peak for bfloat16 compute (format 3): VDPBF16PS's GFLOP/s where the variant runs it."""
    lib = library(isa)
    return max(lib.dt_dot_peak(20_000_000 // 64, threads) for _ in range(3)) if lib else 0.0


def bf16_compute(lib) -> str:
    """How this build runs bfloat16 compute (format 3), for summaries and `dynatree profile`."""
    return "VDPBF16PS" if lib.dt_bf16_dot() else "two FMAs a pair, flushed as it flushes: float32's rate"


def library(isa: str | None = None) -> ctypes.CDLL | None:
    """The loaded kernel of variant ``isa`` (default: ``variant()``), or None (see status())."""
    isa = isa or variant()
    if isa not in _libs:
        try:
            _libs[isa] = _build(isa)
        except OSError as e:  # unwritable cache, unloadable object
            _libs[isa] = None, f"unavailable: {e}"
    return _libs[isa][0]


def status(isa: str | None = None) -> str:
    isa = isa or variant()
    library(isa)
    return _libs[isa][1]


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def packed_bytes(model, bf16_compute: bool = False) -> int:
    """The bytes a packed copy of the model's matrices takes: 2 per weight for bfloat16 compute or
    where one 16-bit format holds them all exactly (weight_format), else 4."""
    mats = [p for p in model.parameters() if p.dim() == 2]
    return sum(p.numel() for p in mats) * (2 if bf16_compute or weight_format(mats) else 4)


# dt_gemm's weight storage formats.  Formats 0-2 compute in float32; their 16-bit formats only
# halve the bytes streamed per forward, and are used only where they hold every weight exactly.
# Format 3 computes in bfloat16 (weights and x rounded to it, products summed in float32 in
# VDPBF16PS's order: csrc/gemm.c): an opt-in precision, not the float32 model's numbers.
FORMATS = {0: torch.float32, 1: torch.bfloat16, 2: torch.float16, 3: torch.bfloat16}
BF16_COMPUTE = 3


def weight_format(weights) -> int:
    """The narrowest dt_gemm format holding every one of ``weights`` (matrices, or lists of a
    matrix's row blocks) exactly: 1 (bfloat16, e.g. a bf16 checkpoint loaded as float32), 2 (half,
    an fp16 checkpoint), else 0 (float32).  ``DYNATREE_WEIGHTS16=0`` keeps float32."""
    if not env_on("DYNATREE_WEIGHTS16"):
        return 0
    bases = {id(t): t for w in weights for b in _blocks(w) for t in [b if b._base is None else b._base]}
    for fmt in (1, 2):  # (each tensor once: a fused matrix's blocks are views of one)
        if all(_exact_in(w, fmt) for w in bases.values()):
            return fmt
    return 0


_EXACT: dict = {}  # id(tensor) -> (weak reference, its version, {format: holds it exactly})
_CHUNK = 1 << 20  # elements per piece of the half-precision check


def _exact_in(w: torch.Tensor, fmt: int) -> bool:
    """Whether 16-bit format ``fmt`` holds every value of ``w`` exactly.  A view is answered for
    the tensor it views (a superset of its values), and the answer remembered per tensor until it
    changes or dies: the memory check and the packing both ask, over every matrix of a model.
    Both checks read the weights once and allocate at most _CHUNK elements: a model of a billion
    weights would otherwise fault in gigabytes of temporaries (seconds, on a VM)."""
    w = w if w._base is None else w._base
    key, got = id(w), _EXACT.get(id(w))
    # in-place edits bump the version (inference tensors keep none); `.data =` moves the address
    version = (None if w.is_inference() else w._version, w.data_ptr())
    if got is None or got[0]() is not w or got[1] != version or version[0] is None:
        got = _EXACT[key] = (weakref.ref(w, lambda _: _EXACT.pop(key, None)), version, {})
    if fmt not in got[2]:
        got[2][fmt] = _bf16_exact(w) if fmt == 1 else _f16_exact(w)
    return got[2][fmt]


def _flat(w: torch.Tensor) -> torch.Tensor:
    """``w``'s values as a 1-D float32 tensor, a view where its storage is dense in some order."""
    w = w.detach()
    dense = w if w.is_contiguous() else w.t() if w.dim() == 2 and w.t().is_contiguous() else w.contiguous()
    return dense.float().reshape(-1)


def _bf16_exact(w: torch.Tensor) -> bool:
    """A float32 is a bfloat16 exactly when its low 16 bits are zero."""
    halves = _flat(w).view(torch.int16)  # (2n,): each float's low half first on a little-endian CPU
    low = halves[0::2] if sys.byteorder == "little" else halves[1::2]
    return not bool(low.any())


def _f16_exact(w: torch.Tensor) -> bool:
    flat = _flat(w)
    return all(torch.equal(x.to(torch.float16).float(), x) for x in flat.split(_CHUNK))


def _blocks(weight) -> list[torch.Tensor]:
    return [weight] if isinstance(weight, torch.Tensor) else list(weight)


class PackedLinear:
    """``y = x W^T + b`` through dt_gemm, over a packed copy of W made once (in format ``fmt``,
    which must hold W exactly: see weight_format).  ``weight``: W, (N, K), or a list of its row
    blocks (n_i, K) in order -- a fused matrix (q, k, v) packed without first copying it whole."""

    def __init__(self, weight, bias: torch.Tensor | None, fmt: int = 0, lib: ctypes.CDLL | None = None):
        lib = lib or library()
        assert lib is not None, status()
        self.lib, self.fmt = lib, fmt
        tw = lib.dt_tile_width()
        blocks = _blocks(weight)
        n_in, n_out = blocks[0].shape[1], sum(b.shape[0] for b in blocks)  # K, N
        self.n_in, self.n_out = n_in, n_out
        self.n_pad = -(-n_out // tw) * tw
        if fmt == BF16_COMPUTE:
            self.packed = _pack_bf16c(blocks, n_in, self.n_pad, tw, lib)
        else:
            self.packed = _pack(blocks, n_in, self.n_pad, tw, FORMATS[fmt], lib.dt_vector_floats())  # (N/TW, K, TW)
        self.bias = None
        if bias is not None:
            self.bias = torch.zeros(self.n_pad, dtype=torch.float32)
            self.bias[:n_out] = bias.detach() if fmt != BF16_COMPUTE else _flushed(bias.detach().float())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., K) float32 -> (..., N)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.n_in).contiguous()  # (M, K)
        y = torch.empty(x2.shape[0], self.n_pad, dtype=torch.float32)  # (M, N_pad)
        self.lib.dt_gemm(x2.data_ptr(), x2.shape[0], self.n_in, self.packed.data_ptr(), self.fmt,
                         self.bias.data_ptr() if self.bias is not None else None, y.data_ptr(), self.n_pad,
                         torch.get_num_threads())
        if self.n_pad != self.n_out:
            y = y[:, :self.n_out]
        return y.view(*lead, self.n_out)


@torch.no_grad()
def _pack(blocks: list[torch.Tensor], n_in: int, n_pad: int, tw: int, dtype: torch.dtype, w: int) -> torch.Tensor:
    """The row blocks of W (N, K) stacked and packed into (n_pad/TW, K, TW) tiles of ``dtype``
    (columns N..n_pad zero) by one strided copy, from W itself when it is one block of whole tiles
    (either layout: plain, or models.cpu_layout's (K, N)), else from a (K, n_pad) copy of this one
    matrix in the packed dtype.  bfloat16 tiles store each k's columns in csrc/vec.h's pair order
    for ``w``-float vectors: column h*w + 4l + i at position 8l + 4h + i."""
    cols = [b.detach().t() for b in blocks]  # (K, n_i) each
    if len(cols) == 1 and cols[0].shape[1] == n_pad:
        wt = cols[0]
    else:  # the blocks side by side, already in the packed dtype
        wt = torch.zeros(n_in, n_pad, dtype=dtype)  # (K, n_pad): columns N..n_pad stay zero
        n0 = 0
        for c in cols:
            wt[:, n0:n0 + c.shape[1]] = c
            n0 += c.shape[1]
    packed = torch.empty(n_pad // tw, n_in, tw, dtype=dtype)
    tiles = wt.unflatten(1, (n_pad // tw, tw)).transpose(0, 1)  # (N/TW, K, TW), column order
    if dtype == torch.bfloat16:  # TW = 2w columns (h, l, i) -> positions (l, h, i), still one copy
        packed.unflatten(2, (w // 4, 2, 4)).copy_(tiles.unflatten(2, (2, w // 4, 4)).transpose(2, 3))
        return packed
    return packed.copy_(tiles)


def _flushed(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its denormals made signed zeros: format 3 reads none (VDPBF16PS treats them as
    zero, x86's emulation under DAZ too; elsewhere the kernels flush only results)."""
    return torch.where(t.abs() < 2.0 ** -126, t * 0, t)


@torch.no_grad()
def _pack_bf16c(blocks: list[torch.Tensor], n_in: int, n_pad: int, tw: int, lib) -> torch.Tensor:
    """W (N, K) rounded to bfloat16 and packed for format 3 (csrc/gemm.c), K padded with a zero
    row to even: (n_pad/TW, K/2, TW, 2) bfloat16 pairs (k = 2j, 2j + 1) where the CPU runs
    VDPBF16PS, else _pack's bfloat16 tiles of the rows in the order 1, 0, 3, 2, ... (each pair
    swapped: the FMAs run the pair's second product first, as VDPBF16PS does)."""
    kp = n_in + n_in % 2
    wt = torch.zeros(kp, n_pad, dtype=torch.bfloat16)  # (Kp, n_pad), rounded to nearest even
    n0 = 0
    for b in blocks:
        wt[:n_in, n0:n0 + b.shape[0]] = b.detach().t()
        n0 += b.shape[0]
    wt = _flushed(wt)
    if lib.dt_bf16_dot():
        tiles = wt.unflatten(0, (kp // 2, 2)).unflatten(2, (n_pad // tw, tw))  # (K/2, 2, N/TW, TW)
        return tiles.permute(2, 0, 3, 1).contiguous()  # (N/TW, K/2, TW, 2)
    swapped = wt.unflatten(0, (kp // 2, 2)).flip(1).reshape(kp, n_pad)  # (Kp, n_pad)
    return _pack([swapped.t()], kp, n_pad, tw, torch.bfloat16, lib.dt_vector_floats())


def _cpu_lib(x: torch.Tensor):
    return library() if x.device.type == "cpu" and x.dtype == torch.float32 and x.stride(-1) == 1 else None


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """logits: (n, V) -> each row's greedy token (first on ties), as host ints.  Host sync.

    A C scan on the CPU: torch's argmax costs ~20 us a row here, a tenth of a draft step."""
    lib = _cpu_lib(logits)
    if lib is None:
        return logits.argmax(-1).tolist()
    out = torch.empty(logits.shape[0], dtype=torch.long)
    lib.dt_argmax(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0), out.data_ptr())
    return out.tolist()


def topk_probs(logits: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """logits: (n, V) -> per row the k most likely tokens' softmax probabilities and ids (host
    lists, most likely first).  Host sync: the caller shapes its tree from these numbers.

    One C call on the CPU in float32 (softmax + top-k of a 2.5M draft's 8192 logits through torch
    is two ops and two transfers, ~4x the time); torch elsewhere."""
    if not 0 <= k <= logits.shape[-1]:  # (C would leave the ids past the vocabulary unwritten)
        raise ValueError(f"top-k of {k} from {logits.shape[-1]} logits per row")
    lib = _cpu_lib(logits) if k else None  # (k = 0: torch's empty rows; the C call would crash)
    if lib is None:
        val, idx = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
        return val.tolist(), idx.tolist()
    n, v = logits.shape
    vals = torch.empty(n, k, dtype=torch.float32)
    ids = torch.empty(n, k, dtype=torch.long)
    lib.dt_softmax_topk(logits.data_ptr(), n, v, logits.stride(0), k, vals.data_ptr(), ids.data_ptr())
    return vals.tolist(), ids.tolist()


def gumbel(k0: int, k1: int, n: int) -> torch.Tensor | None:
    """csrc/neox.c's dt_gumbel: (n,) float32 Gumbel noise for the 32-bit keys (k0, k1), or None
    where the library does not build (sampling.py then computes the same in torch)."""
    lib = library()
    if lib is None:
        return None
    out = torch.empty(n, dtype=torch.float32)
    lib.dt_gumbel(k0, k1, n, out.data_ptr())
    return out


def kv_pointers(layers):
    """The C arrays of the layers' key and value buffer addresses the kernels take."""
    kc = (ctypes.c_void_p * len(layers))(*[layer.keys.data_ptr() for layer in layers])
    vc = (ctypes.c_void_p * len(layers))(*[layer.values.data_ptr() for layer in layers])
    return kc, vc


def cache_keep(cache, start: int, slots: list[int]) -> bool:
    """kvcache.BufferCache.keep in one C call for float32 or bfloat16 CPU buffers; False if it
    does not apply."""
    layers = cache.layers
    k0 = layers[0].keys
    if k0.device.type != "cpu" or k0.dtype not in KV_FORMATS or library() is None:
        return False
    b, h, cap, hd = k0.shape
    kc, vc = cache.pointers()
    src = (ctypes.c_long * len(slots))(*slots)
    library().dt_cache_keep(kc, vc, len(layers), b * h, cap, hd, start, src, len(slots), k0.element_size())
    for layer in layers:
        layer.length = start + len(slots)
    return True
