"""A whole decoder forward as one call into csrc/neox.c: the packed weights, the pointer table the
C code reads, and the call that packs several sequences into one forward.

The architectures' runners build it from their modules -- lean.py (GPT-NeoX) and packed.py (the
Llama family) -- and keep their torch path for what it does not take (other dtypes and devices,
long causal prefills, caches of other element types).  The forward is batch invariant (see the
top of csrc/neox.c): a row's logits are bitwise what it gets alone, so tree logits are AR logits.
"""
from __future__ import annotations

import ctypes
import dataclasses
import sys
from dataclasses import dataclass

import torch

from . import native
from .config import NATIVE_ROWS
from .runtime import KeyMask, Output, Seq, forward_each

# NATIVE_ROWS (config.py): a longer causal forward (a long prompt's prefill) runs in chunks of that many
# rows, one after the other, when it keeps at most this many rows' logits (a prefill keeps one): each
# row's values are the same bits in any chunking (batch invariance), and the work buffer and each
# thread's attention scratch stay bounded.  Chunked, a 1024-token prefill took 119 ms natively against
# 267 ms through torch's GEMMs (bench pair, AMD EPYC Zen 5; 210 ms with the AVX2 build).  A longer one
# keeping more logits runs on torch.
ACTS = {"gelu": 1, "relu": 2, "swiglu": 3}  # csrc/neox.c's ACT_*


@dataclass(frozen=True)
class Layer:
    """One layer's weights as csrc/neox.c takes them (Linear weights (out, in), nn.Linear's; a fused
    matrix may come as a list of its row blocks, see native.PackedLinear)."""

    norm1: tuple  # (weight, bias or None)
    norm2: tuple
    qkv: tuple  # (weight, bias or None): output [q of every head | k of every kv head | v of every kv head]
    out: tuple
    fc1: tuple  # SwiGLU: [gate | up]
    fc2: tuple
    q_norm: torch.Tensor | None = None  # per-head RMS norm weights (Qwen3)
    k_norm: torch.Tensor | None = None


@dataclass(frozen=True)
class Shape:
    d: int
    heads: int
    kv_heads: int
    head_dim: int
    rot: int  # rotary dims of each head (rotate-half convention)
    ff: int
    act: str  # ACTS
    rms: bool  # RMS norms (else layer norms)
    parallel: bool  # GPT-NeoX's parallel residual
    eps: float
    scaling: float


_warned: set = set()


def _rows(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` as the C forward reads it, dense and row-major (a copy only when it is not)."""
    return t if t is None or t.is_contiguous() else t.contiguous()


def _warn_once(why: str) -> None:
    """A float32 CPU model the native kernel cannot serve (no compiler, a DYNATREE_ISA typo) runs
    several times slower on torch's kernels: say so once per process, on stderr (a job's actor
    logs reach the driver), unless asked for (DYNATREE_GEMM=0)."""
    if why not in _warned and "DYNATREE_GEMM=0" not in why:
        _warned.add(why)
        print(f"dynatree: the native CPU kernel is unavailable ({why}); float32 CPU models run on torch's "
              "kernels (slower)", file=sys.stderr, flush=True)


def refusal(model, shape: Shape, gemm: bool, isa: str | None = None, compute: str = "float32") -> str:
    """Why this forward cannot run ``model`` ("" when it can), for the runners' fallback to torch
    and for `dynatree profile` to say."""
    if not gemm:
        return "--kernel lean-mkl asks for torch's kernels"
    if model.device.type != "cpu" or model.dtype != torch.float32:
        half = model.dtype in (torch.bfloat16, torch.float16)  # (a float64 model is asked for its precision)
        hint = "; --dtype float32 --kernel lean-bf16 computes in bfloat16 on it" if model.device.type == "cpu" and half else ""
        return f"a {str(model.dtype).replace('torch.', '')} model on {model.device} (the kernel runs float32 on a CPU{hint})"
    lib = native.library(isa)
    if lib is None:
        _warn_once(native.status(isa))
        return native.status(isa)
    if shape.act not in ACTS:
        return f"its activation {shape.act!r} (the kernel has GELU, ReLU and SwiGLU)"
    if shape.d % 32 or shape.ff % 32 or shape.heads % shape.kv_heads:
        return f"its widths (hidden {shape.d}, MLP {shape.ff}: multiples of 32; {shape.heads} q heads over {shape.kv_heads} kv heads)"
    if not lib.dt_attn_supported(shape.head_dim):
        return f"its head size {shape.head_dim} (the attention kernel takes 16, 32, ..., 128, 160, 192, 256)"
    copy = native.packed_bytes(model, compute == "bfloat16")
    if copy > native.MAX_PACKED_BYTES:
        return (f"its packed copy ({copy / 2**30:.1f} GiB) would pass a quarter of this "
                f"machine's memory ({native.MAX_PACKED_BYTES / 2**30:.1f} GiB)")
    return ""


def untied_linears(model) -> list[torch.nn.Linear]:
    """The model's Linear layers whose weight is not an Embedding's (a tied LM head's is)."""
    embedded = {m.weight.data_ptr() for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight.data_ptr() not in embedded]


class NativeForward:
    def __init__(self, lib, shape: Shape, embed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 final_norm: tuple, lm_head: torch.Tensor, layers: list[Layer], packed=None, compute: str = "float32"):
        """embed: (V, d); cos, sin: (max_pos, rot) float32 rotary tables; final_norm: (weight,
        bias or None); lm_head: (V, d).  Keeps references to every tensor whose address it holds.
        ``packed(w)``, if given, is called with each matrix (or its row blocks) once its packed
        copy is made (Runner.release_packed).  ``compute="bfloat16"``: every matrix product in
        bfloat16 (native.BF16_COMPUTE; the kernel "lean-bf16"), else float32."""
        self.lib, self.shape = lib, shape
        # the C code reads these as row-major memory: a strided view is copied (a tied embedding is
        # the lm_head's matrix, which models.cpu_layout stores transposed for MKL)
        embed, cos, sin = _rows(embed), _rows(cos), _rows(sin)
        final_norm = tuple(map(_rows, final_norm))
        layers = [dataclasses.replace(layer, norm1=tuple(map(_rows, layer.norm1)), norm2=tuple(map(_rows, layer.norm2)),
                                      q_norm=_rows(layer.q_norm), k_norm=_rows(layer.k_norm)) for layer in layers]
        self.weight_format = fmt = native.BF16_COMPUTE if compute == "bfloat16" else native.weight_format(
            [lm_head] + [w for layer in layers for w, _ in (layer.qkv, layer.out, layer.fc1, layer.fc2)])  # (a matrix or its row blocks)
        head = native.PackedLinear(lm_head, None, fmt, lib)
        done = packed or (lambda w: None)
        done(lm_head)
        self.n_vocab, self.vocab_pad = head.n_out, head.n_pad
        self.dims = torch.tensor([shape.d, shape.heads, shape.head_dim, shape.rot, shape.ff, int(shape.parallel),
                                  ACTS[shape.act], self.vocab_pad, embed.shape[0], fmt, shape.kv_heads,
                                  int(shape.rms)], dtype=torch.long)
        self.keep_alive, ptrs = [head, embed, cos, sin, final_norm], []
        addr = lambda t: t.data_ptr() if t is not None else 0  # noqa: E731
        for layer in layers:
            ptrs += [addr(layer.norm1[0]), addr(layer.norm1[1]), addr(layer.norm2[0]), addr(layer.norm2[1])]
            for w, b in (layer.qkv, layer.out, layer.fc1, layer.fc2):
                pm = native.PackedLinear(w, b, fmt, lib)
                done(w)
                self.keep_alive.append(pm)
                ptrs += [pm.packed.data_ptr(), addr(pm.bias)]
            ptrs += [addr(layer.q_norm), addr(layer.k_norm)]
            self.keep_alive += [layer.norm1, layer.norm2, layer.q_norm, layer.k_norm]  # not the (fused) matrices
        self.ptrs = (ctypes.c_void_p * len(ptrs))(*ptrs)
        self.head_ptrs = (ctypes.c_void_p * 3)(addr(final_norm[0]), addr(final_norm[1]), head.packed.data_ptr())
        self.work = torch.empty(0)
        # plain ints and addresses, looked up once: the call below runs a few thousand times a second
        self.work_per_row = lib.dt_work_per_row(self.dims.data_ptr())
        self.n_layers, self.n_embed = len(layers), embed.shape[0]
        self.dims_ptr, self.embed_ptr = self.dims.data_ptr(), embed.data_ptr()
        self.cos_ptr, self.sin_ptr = cos.data_ptr(), sin.data_ptr()

    def takes(self, n: int, mask, cache, keep: int = 0) -> bool:
        """Whether this forward runs a sequence of n new rows keeping ``keep`` rows' logits (0:
        all): masked, or causal up to NATIVE_ROWS rows or keeping at most that many, into a cache
        whose element type it reads."""
        return (cache is not None and (mask is not None or n <= NATIVE_ROWS or 0 < keep <= NATIVE_ROWS)
                and (getattr(cache.layers[0], "store", None) or torch.float32) in native.KV_FORMATS)

    def __call__(self, seqs: list[Seq], topk: int = 0, argmax: bool = False, cols: int | None = None) -> list[Output]:
        """The sequences' forward (runtime.py's runner contract): long causal ones first run all
        but their last NATIVE_ROWS rows in chunks, then every sequence's rest in one call."""
        seqs = [self._lead_in_chunks(s) if s.mask is None and len(s.ids) > NATIVE_ROWS else s for s in seqs]
        return self._run(seqs, topk, argmax, cols)

    def _lead_in_chunks(self, s: Seq) -> Seq:
        """Feed a long causal sequence's rows before its last max(NATIVE_ROWS, keep) through the
        cache, NATIVE_ROWS at a time (their logits unread); returns the sequence's rest."""
        n = len(s.ids)
        tail = max(NATIVE_ROWS, s.keep or n)
        for a in range(0, n - tail, NATIVE_ROWS):
            b = min(a + NATIVE_ROWS, n - tail)
            self._run([Seq(s.ids[a:b], s.cache, None if s.positions is None else s.positions[a:b], keep=1)], 0, False, 1)
        if tail >= n:
            return s
        return dataclasses.replace(s, ids=s.ids[n - tail:], positions=None if s.positions is None else s.positions[n - tail:])

    def _run(self, seqs: list[Seq], topk: int, argmax: bool, cols: int | None) -> list[Output]:
        """The sequences' forward as one call.

        Lean on purpose: a draft forward is ~0.1 ms of C, so every microsecond of Python here shows."""
        descs = (native.DtSeq * len(seqs))()
        ids, pos, alive, kept = [], [], [], 0
        cols = self.n_vocab if cols is None else min(cols, self.n_vocab)
        for d, s in zip(descs, seqs):
            n, cache = len(s.ids), s.cache
            past = cache.length
            end = past + n
            keep = s.kept
            ids.append(s.ids)
            pos.append(s.positions)
            if s.mask is not None:
                allowed = s.mask.allowed if s.mask.allowed.is_contiguous() else s.mask.allowed.contiguous()
                if allowed.shape != (n, end - s.mask.visible):
                    raise ValueError(f"mask covers {tuple(allowed.shape)} keys, expected {(n, end - s.mask.visible)}")
                alive.append(allowed)
                d.visible, d.allowed = s.mask.visible, allowed.data_ptr()
            layers = cache.layers
            if not layers[0].is_initialized or end > layers[0].capacity:
                for layer in layers:
                    layer.reserve(end, self.shape.kv_heads, self.shape.head_dim, torch.float32, torch.device("cpu"))
            kc, vc = cache.pointers()
            d.kc, d.vc = ctypes.addressof(kc), ctypes.addressof(vc)
            alive.append((kc, vc))
            d.rows, d.past, d.cap, d.keep = n, past, layers[0].capacity, keep
            d.kvfmt = native.KV_FORMATS[layers[0].keys.dtype]
            if cache.shared is not None:  # a shared prompt prefix: read from its one copy (prefix.py)
                ends, ks, vs, scaps = cache.shared.pointers()
                d.nshare, d.ends, d.scaps = len(ends), ctypes.addressof(ends), ctypes.addressof(scaps)
                d.ks, d.vs = ctypes.addressof(ks), ctypes.addressof(vs)
            if s.perturb is not None:  # sampling's heads: one noise row per kept row
                noise = [g if g.dtype == torch.float32 else g.float() for g in s.perturb.noise(cols)]
                rows = (ctypes.c_void_p * keep)(*[g.data_ptr() for g in noise])
                alive.append((noise, rows))
                d.noise, d.inv_temp = ctypes.addressof(rows), s.perturb.inv_temp
            kept += keep
        ids = ids[0] if len(ids) == 1 else torch.cat(ids)  # (n,)
        if ids.dtype != torch.long or not ids.is_contiguous():
            ids = ids.long().contiguous()
        n = ids.shape[0]
        if all(p is None for p in pos):
            pos = None  # consecutive positions past.. are computed in C
        else:
            pos = torch.cat([p.long() if p is not None else torch.arange(s.cache.length, s.cache.length + len(s.ids))
                             for p, s in zip(pos, seqs)]).contiguous()  # (n,)
        return self._call(descs, seqs, ids, pos, kept, topk, argmax, cols)

    def _call(self, descs, seqs, ids, pos, kept, topk, argmax, cols) -> list[Output]:
        n = ids.shape[0]
        if self.work.numel() < n * self.work_per_row:
            self.work = torch.empty(n * self.work_per_row)
        logits = torch.empty(kept, self.vocab_pad)  # (sum keep, V_pad)
        vals = top = None
        mode = 0
        if topk:
            mode = k = min(topk, cols)
            vals, top = torch.empty(kept, k), torch.empty(kept, k, dtype=torch.long)  # (sum keep, k)
        elif argmax:
            mode, top = -1, torch.empty(kept, dtype=torch.long)  # (sum keep,)
        bad = self.lib.dt_neox_forward(
            self.dims_ptr, self.shape.eps, self.shape.scaling, self.n_layers, self.ptrs, self.embed_ptr,
            self.head_ptrs, ids.data_ptr(), n, pos.data_ptr() if pos is not None else None, self.cos_ptr,
            self.sin_ptr, descs, len(seqs), logits.data_ptr(), self.work.data_ptr(), torch.get_num_threads(), cols,
            mode, vals.data_ptr() if vals is not None else None, top.data_ptr() if top is not None else None)
        if bad:
            raise IndexError(f"token id outside the embedding (0 .. {self.n_embed - 1})")
        for d, s in zip(descs, seqs):
            for layer in s.cache.layers:
                layer.length = d.past + d.rows
        if self.vocab_pad != self.n_vocab:
            logits = logits[:, :self.n_vocab]
        # host sync (heads): the caller shapes a tree from these, or accepts the target's choices
        heads = vals.tolist() if mode > 0 else None, top.tolist() if mode else None
        outs, r = [], 0
        for d in descs:
            lg = logits[r:r + d.keep][None]  # (1, keep, V)
            if mode > 0:
                outs.append(Output(lg, (heads[0][r:r + d.keep], heads[1][r:r + d.keep])))
            elif mode < 0:
                outs.append(Output(lg, choice=heads[1][r:r + d.keep]))
            else:
                outs.append(Output(lg))
            r += d.keep
        return outs


class Runner:
    """The runner contract (runtime.py) of the models with a C forward (lean.LeanNeoX,
    packed.PackedRunner): the sequences run here in one call when the C forward takes them all,
    else each on the path that takes it; a subclass sets ``native`` and ``fwd`` and supplies the
    torch path ``_torch(seqs, topk, argmax, cols)``."""

    native = False
    fwd: NativeForward
    released = 0  # bytes of float32 matrices freed (release_packed, release_matrices; 0: the torch path can run)

    def packed_callback(self, release: bool):
        """What NativeForward calls as it packs each matrix: with ``release``, free its float32 source
        there and then (release_packed), else nothing."""
        if not release:
            return None
        # by storage: a matrix arrives as the Linear's weight, a view of it, or row blocks viewing it
        # (never an embedding's; a storage two Linears share is left alone: the second is still to pack)
        owner, shared = {}, set()
        for m in untied_linears(self.model):
            ptr = m.weight.untyped_storage().data_ptr()
            if ptr in owner:
                shared.add(ptr)
            owner[ptr] = m.weight

        def release_packed(w) -> None:
            """Free the float32 matrix ``w`` (or the one its row blocks view) now that it is packed: a
            job's actors load a model at about its float32 size instead of float32 plus the packed copy."""
            for t in w if isinstance(w, list) else [w]:
                ptr = t.untyped_storage().data_ptr()
                if ptr in owner and ptr not in shared:
                    self._free(owner[ptr])
        return release_packed

    def _free(self, weight: torch.Tensor) -> None:
        """Free a Linear's weight: its storage too, which row-block views (a fused matrix being
        packed) would otherwise keep until they go -- nothing reads them again."""
        if weight.numel():
            self.released += weight.numel() * weight.element_size()
            store = weight.untyped_storage()
            if store.nbytes() == weight.numel() * weight.element_size():  # the matrix's own storage alone
                try:
                    store.resize_(0)
                except RuntimeError:  # not resizable (memory-mapped): it goes with its last view
                    pass
            weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)

    def release_matrices(self) -> int:
        """Free the model's Linear weights, which the C forward keeps packed copies of, and return
        the bytes freed (0 when the C forward does not run this model).  Why: a CPU actor of a
        billion-parameter model holds them twice (float32 for torch, 16-bit or float32 packed),
        and the engine's forwards all take the C path; what they free holds rows' caches instead
        (jobs/footprint.py).  A torch-path forward afterwards raises, saying why.  An embedding's
        matrix (a tied LM head's too) is kept: the C forward reads its rows."""
        if not self.native:
            return 0
        for m in untied_linears(self.model):
            self._free(m.weight)
        return self.released

    def __call__(self, input_ids: torch.Tensor, attention_mask=None, position_ids=None, past_key_values=None,
                 use_cache: bool = True, logits_to_keep: int = 0, topk: int = 0, argmax: bool = False,
                 cols: int | None = None, perturb=None) -> Output:
        """One sequence, transformers-style arguments.  input_ids: (1, n); attention_mask: a
        KeyMask, additive (1, 1, n, P + n) or None (causal); position_ids: (1, n) or None (P ..
        P+n-1); past_key_values: a BufferCache holding P tokens.  Returns a runtime.Output:
        ``.logits`` (1, n or logits_to_keep, V), and the softmax top-k (``topk``) or argmax
        (``argmax``) of each kept row's first ``cols`` logits, host lists."""
        if (self.native and attention_mask is not None and not isinstance(attention_mask, KeyMask)
                and self.fwd.takes(input_ids.shape[1], attention_mask, past_key_values, logits_to_keep)):
            attention_mask = KeyMask.from_additive(attention_mask)  # additive (1, 1, n, P + n)
        seq = Seq(input_ids.reshape(-1), past_key_values, None if position_ids is None else position_ids.reshape(-1),
                  attention_mask, logits_to_keep, perturb)
        return self.forward([seq], topk=topk, argmax=argmax, cols=cols)[0]

    def forward(self, seqs: list[Seq], topk: int = 0, argmax: bool = False, cols: int | None = None) -> list[Output]:
        """Several sequences' new tokens -> one Output each, in one packed forward: every row in
        one pass over the weights, each attending to its own cache.  The C forward's is bitwise
        what each row would get alone; the torch one's GEMMs span all rows (exact in float64; in
        float32 and lower a row's rounding may depend on its neighbours)."""
        if self.native:
            if all(self.fwd.takes(len(s.ids), s.mask, s.cache, s.keep) for s in seqs):
                return self.fwd(seqs, topk, argmax, cols)
            if self.fwd.weight_format == native.BF16_COMPUTE:  # torch's path would compute in float32
                raise RuntimeError("--kernel lean-bf16 computes on the native kernel only, which does not take "
                                   f"{[(len(s.ids), s.keep, s.cache is not None) for s in seqs]} (rows, kept, cached)")
            if len(seqs) > 1:  # one the C forward does not take beside ones it does: each on its path
                return forward_each(self, seqs, topk=topk, argmax=argmax, cols=cols)
        if self.released:
            raise RuntimeError("this forward needs torch's path, whose float32 weights were released for the "
                               "native kernel's packed copies (Runner.release_matrices, in a job's actors): "
                               f"{[(len(s.ids), s.keep, s.cache is not None) for s in seqs]} (rows, kept, cached)")
        for s in seqs:
            if s.cache is not None and getattr(s.cache, "shared", None) is not None:
                s.cache.own_slots()  # torch reads the cache's own slots (prefix.Shared)
        return self._torch(seqs, topk, argmax, cols)
