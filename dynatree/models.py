"""Loading a target/draft pair and checking that the two can speculate for each other."""
from __future__ import annotations

import inspect
import os
import json
import re
import threading
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from .config import DTYPE_ALIASES, DTYPE_NAMES, KERNELS, NATIVE_KERNELS, SLOW_ON_CPU, dtype_name, is_device_name
from .cmodel import untied_linears
from .metrics import release_freed_memory
from .names import (TOKENIZER_FILES, context_len, default_pair_dir, lacks_tokenizer, model_problem, native_refusal,
                    no_tree_mask, rope_switch)
from .runtime import KeyMask, Seq, base_forward_source, forward_each, heads_each, model_window, with_heads

DTYPES = {name: getattr(torch, dtype_name(name)) for name in (*DTYPE_NAMES, *DTYPE_ALIASES)}


class PairError(ValueError):
    """The target and draft cannot be used together (or cannot be loaded)."""


def resolve_device(spec: str | torch.device = "auto") -> torch.device:
    """A device the engine runs on (and is tested on); PairError for any other, or one this process lacks."""
    if isinstance(spec, torch.device):  # (checked as its name is: torch.device("mps") failed in torch, later)
        spec = "cpu" if spec.type == "cpu" else str(spec)  # (torch.device("cpu", 0) is the CPU)
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not is_device_name(spec):  # ("auto": resolved above)
        raise PairError(f"device must be auto, cpu, cuda or cuda:N, got {spec!r}")
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise PairError(f"device {spec!r} requested but CUDA is not available")
    device = torch.device(spec)
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise PairError(f"device {spec!r} requested but this process sees {torch.cuda.device_count()} GPU(s), "
                        "numbered from 0 (CUDA_VISIBLE_DEVICES renumbers them)")
    return device


def resolve_dtype(spec: str | torch.dtype) -> torch.dtype:
    """A model dtype (DTYPE_NAMES, or a short name); PairError for any other (torch.int8 read as a broken checkpoint)."""
    if isinstance(spec, torch.dtype) and spec in DTYPES.values():
        return spec
    try:
        return DTYPES[spec]
    except (KeyError, TypeError):
        raise PairError(f"unknown dtype {spec!r}; choose one of float32 (fp32), bfloat16 (bf16), float16 (fp16), "
                        "float64 (fp64)") from None


_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its lock (model_lock)
_LOCKS_LOCK = threading.Lock()
LEARNED_KEPT = 32  # ModelPair.learned: entries of one kind a pair keeps
_SEAM_TOKENS = 4  # ModelPair.decoder: prompt tokens a continuation is decoded after


def model_lock(model) -> threading.RLock:
    """One lock per model object, held by every forward transformers' runners make of it: a joined
    forward (joined.py) names its attention implementation in the model's config for its
    duration, which a forward of the same model in another thread (two pairs built on one model)
    would otherwise read mid-flight.  Kept beside the model, not on it: a lock would make the
    model impossible to copy or pickle."""
    with _LOCKS_LOCK:
        return _LOCKS.setdefault(model, threading.RLock())


def cache_kw(model) -> str:
    """The name of a transformers forward's cache argument: 5.x renames past_key_values to cache
    (the old name warns, then goes in 5.40); the engine says past_key_values, as older 5.x takes it."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class HFRunner:
    """transformers' own forward, given the additive 4-D mask it expects for a KeyMask."""

    def __init__(self, model):
        self.model, self.config, self.dtype, self.device = model, model.config, model.dtype, model.device
        # A 4-D mask is taken as given, so the model's sliding window must be in it; with full and
        # sliding layers both (Qwen2's max_window_layers) the model takes one mask per layer kind.
        self.window = model_window(model)
        self.switch = rope_switch(model.config)  # padded forwards keep sequences on one side of it (padded.py)
        self.mixed = (self.window is not None and "causal_mask_mapping" in base_forward_source(model)
                      and "full_attention" in (getattr(self.config, "layer_types", None) or ()))
        self.cache_kw = cache_kw(model)
        self.lock = model_lock(model)

    def __call__(self, attention_mask=None, topk: int = 0, argmax: bool = False, cols: int | None = None,
                 perturb=None, **kwargs):
        """transformers' arguments, plus the heads of runtime.Output (computed after the forward)."""
        if isinstance(attention_mask, KeyMask):
            attention_mask = self._additive(attention_mask, kwargs)
        if "past_key_values" in kwargs:
            kwargs[self.cache_kw] = kwargs.pop("past_key_values")
        with self.lock:
            logits = self.model(attention_mask=attention_mask, **kwargs).logits
        return with_heads(logits, topk, argmax, cols, perturb)

    def _additive(self, mask: KeyMask, kwargs: dict):
        """A KeyMask as the additive 4-D mask(s) the model takes: with its sliding window, the keys
        an AR step at each row's position would not see are masked too."""
        full = mask.additive(self.dtype)  # (1, 1, n, k)
        if self.window is None:
            return full
        pos = kwargs.get("position_ids")
        if pos is None:
            cache = kwargs.get("past_key_values")
            start = cache.get_seq_length() if cache is not None else 0
            pos = torch.arange(start, start + full.shape[-2])
        windowed = full.masked_fill(mask.beyond_window(pos, self.window)[None, None], torch.finfo(self.dtype).min)
        return {"full_attention": full, "sliding_attention": windowed} if self.mixed else windowed

    tree_problem = ""  # why it cannot verify token trees (models._tree_problem; "" when it can)
    tree_fails = False  # its tree forward raises: as a draft it cannot grow trees
    batch_problem = "not probed"  # why it runs one sequence per forward (models._batch_problems; "" when it pads)
    joined_problem = "not probed"  # why it does not join sequences (models._batch_problems; "" when it does)
    joined = None  # the model's attention implementation, run per sequence in a joined forward (joined.py)

    def forward(self, seqs, topk: int = 0, argmax: bool = False, cols: int | None = None):
        """runtime.Seq inputs -> one runtime.Output each: several sequences in one padded forward
        (padded.py) where that pads nothing and copies no cache (equal widths, rows that stay
        together sharing one block: one attention call per layer), else in one joined forward
        (joined.py: no padding, attention per sequence), each where the model passed that path's
        probe, else one forward per sequence; all their heads read back at once (heads_each; per
        sequence, each read was a wait on a GPU)."""
        from .joined import forward_joined  # (with padded.py: transformers' modeling imports, ~1.3 s,
        from .padded import forward_padded, in_place  # that a native-kernel actor never needs)

        together = len(seqs) > 1 and all(s.cache is not None for s in seqs)
        with self.lock:
            forwards = in_place(self, seqs) if together and not self.batch_problem else None
            if together and not self.joined_problem and not forwards:
                parts = forward_joined(self, seqs)
            elif together and not self.batch_problem:
                parts = forward_padded(self, seqs, forwards)
            else:
                parts = [o.logits for o in forward_each(self, [replace(s, perturb=None) for s in seqs])]  # no read
        keeps = [p.shape[1] for p in parts]
        logits = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # (1, K, V)
        del parts  # (the rows' own copies: a batch's logits once, not twice)
        return heads_each(logits, keeps, topk, argmax, cols, [s.perturb for s in seqs])


PROBE_TOKENS, PROBE_RTOL = 12, 1e-3
# bfloat16 inputs carry 8 significant bits: logits move by ~1e-2 of their scale; a kernel bug by ~1
PROBE_RTOL_BF16 = 0.1
# architectures whose attention follows cache slots, named so a 16-bit model (whose probe must
# allow for rounding) or one whose slot effects no short probe shows (Llama 4's 8192-token chunks
# and NoPE temperature floor, GPT-Neo's 256-token local window counted back from the slot) is never
# trusted with trees
SLOT_BOUND = {"llama4": "Llama 4's attention chunks and temperature follow cache slots",
              "llama4_text": "Llama 4's attention chunks and temperature follow cache slots",
              "mpt": "MPT's ALiBi bias follows cache slots",
              "gpt_neo": "GPT-Neo's local attention window follows cache slots"}
SLOT_WINDOWS = ("window_size", "attention_window_size")  # window keys read by slot (not sliding_window's mask)
TREE_RTOL_16BIT = 3e-2  # the probes' tolerance for float16/bfloat16 models (SDPA with and without a mask)


@torch.inference_mode()
def _tree_problem(run: HFRunner, model, which: str) -> tuple[str, bool]:
    """Why transformers' forward of ``model`` cannot verify a token tree ("" when it can), and
    whether its tree forward fails outright (such a draft cannot grow trees; an inexact one only
    proposes worse).  A short prompt is cached, then (a) its AR steps over a path must give the
    logits of the model's own uncached forward -- else a PairError: the model keeps state
    outside dynatree's KV caches (state-space, recurrent or linear-attention layers) -- and (b) a
    4-node tree (root -> a -> c, root -> b) must give each node its AR steps' logits.  Its nodes
    sit at cache slots past their positions, where architectures that read positions from slots
    (MPT's ALiBi) or take no 4-D mask (BLOOM) part from AR."""
    from .tree import ancestor_matrix, long_tensor

    cfg, dev, rtol = model.config, run.device, _probe_rtol(run)
    prompt, nodes, cache, ar = _ar_probe(run, model, which, rtol)
    slots = _slot_bound(cfg)
    if slots:
        return slots, False
    n = len(prompt)
    cache.truncate(n)
    try:
        got = run.forward([Seq(long_tensor(nodes, dev), cache, long_tensor([n, n + 1, n + 1, n + 2], dev),
                               KeyMask(n, ancestor_matrix([-1, 0, 0, 1]).to(dev)))])[0].logits[0].float()
    except Exception as e:  # noqa: BLE001 -- whatever transformers raises
        why = no_tree_mask(cfg)
        return f"{why + ': ' if why else ''}a token tree's forward fails ({type(e).__name__}: {str(e)[:120]})", True
    gap = _gap(got, torch.stack([ar[u] for u in range(4)]))
    return ("" if gap <= rtol else f"a token tree's logits part from AR's by {gap:.3g} of their scale"), False


@torch.inference_mode()
def _batch_problems(run: HFRunner, model) -> tuple[str, str]:
    """Why transformers' forward of ``model`` cannot score several sequences in one padded forward
    (padded.py), and why not in one joined forward (joined.py) ("" where it can): two sequences of
    different lengths are prefilled together, then one scores a 3-node tree and the other one
    token, and each must get the logits it gets alone.  A model whose forward reads the padding (a
    mask it rebuilds, positions from its cache) fails the padded probe, one whose attention needs
    more than its own keys and mask (ALiBi built from a 2-D mask) the joined one; an architecture
    named as slot-bound (:func:`_slot_bound`), whose effects only show past a window or chunk this
    probe never reaches, takes neither."""
    from .kvcache import new_cache
    from .tree import ancestor_matrix, long_tensor

    if run.tree_fails:
        return ("its forward takes no 4-D mask",) * 2
    slots = _slot_bound(model.config)
    if slots:  # (GPT-Neo's window counts back from the padded block's end; Llama 4 reads the group's length)
        return (slots,) * 2
    dev, rtol = run.device, _probe_rtol(run)
    n = max(2, min(7, _context_len(model) - 4))
    g, vocab = torch.Generator().manual_seed(2), _probe_vocab(model)
    prompts = [torch.randint(0, vocab, (k,), generator=g).to(dev) for k in (n, n - 1)]
    news = [Seq(torch.randint(0, vocab, (3,), generator=g).to(dev), None, long_tensor([n, n + 1, n + 1], dev),
                KeyMask(n, ancestor_matrix([-1, 0, 0]).to(dev))),
            Seq(torch.randint(0, vocab, (1,), generator=g).to(dev), None)]

    def run_all(forward) -> list[torch.Tensor]:
        caches = [new_cache(run, n + 4) for _ in prompts]
        first = [Seq(p, c) for p, c in zip(prompts, caches)]
        second = [replace(s, cache=c) for s, c in zip(news, caches)]
        if forward is not None:
            return forward(run, first) + forward(run, second)
        return [forward_each(run, [s])[0].logits for s in first + second]

    alone = run_all(None)

    def problem(forward, what: str) -> str:
        try:
            got = run_all(forward)
        except Exception as e:  # noqa: BLE001 -- whatever transformers raises
            return f"a {what} forward raised {type(e).__name__} in the load-time probe: {str(e)[:120]}"
        gap = max(_gap(a.float(), b.float()) for a, b in zip(got, alone))
        return "" if gap <= rtol else f"a {what} forward's logits part from each sequence's own by {gap:.3g} of their scale"

    from .joined import forward_joined, inner_implementation
    from .padded import forward_padded

    run.joined = inner_implementation(model)
    joined = problem(forward_joined, "joined") if run.joined else (
        f"its attention ({model.config._attn_implementation}) is neither SDPA nor eager")
    return problem(forward_padded, "padded"), joined


def _probe_rtol(run: HFRunner) -> float:
    """How far a probe's logits may part from their reference, relative to their scale."""
    return PROBE_RTOL if run.dtype in (torch.float32, torch.float64) else TREE_RTOL_16BIT


def _probe_vocab(model) -> int:
    """The ids a probe may feed: the config's vocabulary, or fewer where the embedding has fewer
    rows (padded configs)."""
    try:
        rows = getattr(model.get_input_embeddings(), "num_embeddings", None)
    except (AttributeError, NotImplementedError):
        rows = None
    return min(model.config.vocab_size, rows or model.config.vocab_size)


def _slot_bound(cfg) -> str:
    """Why the architecture's attention follows cache slots, by name or config key ("" if nothing
    says so): such effects show only past a window or chunk no short probe reaches."""
    if cfg.model_type in SLOT_BOUND:
        return SLOT_BOUND[cfg.model_type]
    key = next((k for k in SLOT_WINDOWS if isinstance(getattr(cfg, k, None), int)), None)
    return f"its {key} follows cache slots" if key else ""


def _gap(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference, relative to the logits' scale (at least 1)."""
    return (got - want).abs().max().item() / max(1.0, want.abs().max().item())


def _ar_probe(run: HFRunner, model, which: str, rtol: float):
    """_tree_problem's part (a): (prompt, 4 node tokens, the cache, AR logits per node of the tree's
    two root-to-leaf paths), or a PairError."""
    from .kvcache import new_cache
    from .tree import long_tensor

    n, dev, vocab = max(1, min(8, _context_len(model) - 5)), run.device, _probe_vocab(model)
    g = torch.Generator().manual_seed(1)
    prompt, nodes = (torch.randint(0, vocab, (k,), generator=g).tolist() for k in (n, 4))
    cache, ar = new_cache(run, n + 4), {}
    try:
        run.forward([Seq(long_tensor(prompt, dev), cache, keep=1)])
        for path in ((0, 1, 3), (0, 2)):
            cache.truncate(n)
            for u in path:
                ar[u] = run.forward([Seq(long_tensor([nodes[u]], dev), cache)])[0].logits[0, 0].float()
        full = run(input_ids=long_tensor(prompt + [nodes[u] for u in (0, 1, 3)], dev)[None],
                   use_cache=False).logits[0, -3:].float()  # (3, V): the model's own forward, no cache
    except Exception as e:  # noqa: BLE001 -- whatever transformers raises, the model cannot run here
        try:  # dynatree's caches to blame only where the model's own uncached forward runs
            run(input_ids=long_tensor(prompt, dev)[None], use_cache=False)
        except Exception as own:  # noqa: BLE001
            dtype = str(run.dtype).replace("torch.", "")
            raise PairError(f"the {which} model ({model.config.model_type}) does not run in {dtype} on {dev.type}: "
                            f"transformers' own forward fails ({type(own).__name__}: {own}); try another --dtype") from None
        raise PairError(f"the {which} model ({model.config.model_type}) cannot run on dynatree's KV caches: "
                        f"{type(e).__name__}: {e}") from None
    gap = _gap(torch.stack([ar[u] for u in (0, 1, 3)]), full)
    if gap > rtol:
        raise PairError(f"the {which} model ({model.config.model_type}) cannot run on dynatree's KV caches: "
                        f"decoding on them parts from its own forward by {gap:.3g} of the logits' scale (it keeps "
                        "state outside the key/value cache)")
    return prompt, nodes, cache, ar


@torch.inference_mode()
def _probe_logits(run, model) -> torch.Tensor:
    """``run``'s logits over a fixed prompt of up to PROBE_TOKENS tokens (float32)."""
    from .kvcache import new_cache

    n = max(1, min(PROBE_TOKENS, _context_len(model) - 1))
    ids = torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    return run.forward([Seq(ids, new_cache(run, n + 1))])[0].logits.float()


def _twin(cls, model) -> tuple:
    """The same forward on torch's ops (no oneDNN copy: it lives a moment) and its probe logits."""
    twin = cls(model, gemm=False, pack=False)
    return twin, _probe_logits(twin, model)


def _probed(run, model, which: str, twin, bf16: bool = False):
    """``run``, a native forward, if its logits over a fixed 12-token prompt agree with ``twin``'s,
    the same forward on torch's ops (within PROBE_RTOL of the logits' scale; float32 summation
    orders differ by ~1e-6), else that torch forward, with a warning.  Why: the native kernel is
    checked against torch by the tests on the shapes they build; on a model they never saw, a
    kernel bug (a tied embedding read with the wrong strides was one) makes ``ar`` wrong too, and
    no check against ``ar`` could see it.  ``twin``: :func:`_twin`'s, taken before ``run`` was
    built where that frees the float32 weights the torch forward reads.  ``bf16``: ``run`` computes in
    bfloat16 (lean-bf16), compared within PROBE_RTOL_BF16; torch's float32 forward is no stand-in."""
    twin, torch_logits = twin
    native_logits = _probe_logits(run, model)
    gap, scale = (native_logits - torch_logits).abs().max().item(), max(1.0, torch_logits.abs().max().item())
    if gap <= (PROBE_RTOL_BF16 if bf16 else PROBE_RTOL) * scale:
        return run
    why = f"its logits differed from torch's by {gap:.3g} on a probe prompt (a native-kernel bug: please report it)"
    if bf16:
        raise PairError(f"the {which} model cannot run with --kernel lean-bf16: {why}")
    if run.released:  # torch's path has nothing left to run on
        raise PairError(f"the {which} model cannot run on the native kernel: {why}; run it with --kernel lean-mkl")
    twin.refusal = why
    warnings.warn(f"the {which} model runs on torch's ops, not the native kernel: {twin.refusal}", stacklevel=3)
    return twin


TAIL_CHARS_PER_TOKEN = 16  # ModelPair._encode_tail: the first suffix's characters per wanted token
_WORD_GAP = re.compile(r"[^\W\d_](?= [^\W\d_])")  # a letter before " " and a letter


def batch_paths(run: HFRunner) -> str:
    """How transformers' runner scores several sequences (HFRunner.forward), for forward_in_use."""
    if not run.batch_problem and not run.joined_problem:
        return "batches joined, or padded where rows share a block"
    if not run.joined_problem:
        return f"batches joined (not padded: {run.batch_problem})"
    if not run.batch_problem:
        return f"batches padded (not joined: {run.joined_problem})"
    return f"one sequence per forward ({run.batch_problem})"


def _word_boundary(text: str, at: int, within: int) -> int | None:
    """The index of the last space between two letters at or before ``at`` (no further back than
    ``within`` characters), or None."""
    lo = max(at - within, 0)
    found = None
    for found in _WORD_GAP.finditer(text, lo, at + 1):
        pass
    return None if found is None else found.end()


@dataclass
class ModelPair:
    """A target and its draft (None for ``ar`` alone) with the tokenizer they share, on one device:
    what ``load_pair`` (or ``pair_from_models``) returns and every decoding call takes.  Load it once
    and reuse it: it keeps its runners, learned statistics and prefix caches across calls, and
    threads sharing it take turns (its lock)."""

    target: torch.nn.Module = field(repr=False)  # (a notebook showing the pair printed both module trees)
    draft: torch.nn.Module | None = field(repr=False)
    tokenizer: object | None = field(repr=False)
    device: torch.device
    dtype: torch.dtype
    vocab: int  # logit columns both models score (tokens ids < vocab are comparable)
    max_context: int  # most tokens (prompt + generated) a sequence may hold
    names: dict = field(default_factory=dict)
    state: dict = field(default_factory=dict, repr=False)  # per-pair measurements (latency profile, calibration)
    # "lean": lean.py's forward through dynatree's C kernels (native.py) where they build; "lean-mkl":
    # the same forward on torch's MKL/oneDNN kernels; "hf": transformers' own forward
    kernel: str = "lean"
    # every id that ends a generation (an instruct model's end of turn beside its end of text, ...)
    eos_token_ids: tuple = ()
    # keys/values of shared prompt prefixes kept per model and cache dtype (prefix.py); 0 turns it off
    prefix_cache_bytes: int = 1 << 30
    # free each float32 matrix as the native kernel packs it (cmodel.Runner.packed_callback): a job's
    # actors, whose forwards all take the kernel (config.within_native_rows), set it before the first
    # runner() -- loading then peaks near the float32 model, not it plus the packed copy
    release_packed: bool = False
    # held by every step of decoding and every runner build: a runner's buffers and caches, the
    # prefix store and the budget's measurements are the pair's, so two threads decoding with one
    # pair take turns (without it the native forward's shared work buffer mixed their tokens)
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)
    # logit columns the target scores (0: vocab): its argmax may pick an id the draft cannot read,
    # which a prompt may then hold; a drafter meeting one retires (drafting.DraftVocabError)
    target_vocab: int = 0
    # the draft's context where it is shorter than the target's (else 0): the draft restarts on the
    # text's latest tokens within it (drafting.Drafter.positions) while the target reads the whole text
    draft_positions: int = 0

    @property
    def context_said(self) -> str:
        """The context a sequence is held to (the target's)."""
        return f"the {self.max_context}-token context"

    def context_of(self, which: str) -> int:
        """The positions of the ``"target"`` (the pair's context) or the ``"draft"``."""
        return self.draft_positions or self.max_context if which == "draft" else self.max_context

    def window_limit(self, cfg) -> tuple[int, str, str]:
        """config.window_limit for this pair: the context a cache window of ``cfg`` must fit."""
        from .config import window_limit

        return window_limit(cfg, self.max_context, self.draft_positions)

    @property
    def id_limit(self) -> int:
        """Token ids are [0, id_limit): the ids the target can produce (prompts, stop ids)."""
        return self.target_vocab or self.vocab

    @property
    def eos_token_id(self) -> int | None:
        """The first of eos_token_ids (a padding id for transformers' peers), or None."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def learned(self, key: tuple, fresh, carry=None):
        """What decoding learned under ``key`` -- a governor, a calibration, lookup statistics: the
        one kept (or ``carry(it)``, what a new user takes from it), else ``fresh()``.  At most
        LEARNED_KEPT of a kind (``key[0]``) are kept, the least recently used dropped first: keyed by
        sampling settings, a service sending each request at its own temperature added one per
        temperature for the process's life (a dropped one starts again from the prior: speed, never
        the output)."""
        last = self.state.pop(key, None)  # (popped and put back last: the most recently used)
        value = fresh() if last is None else carry(last) if carry else last
        kind = [k for k in self.state if isinstance(k, tuple) and k[0] == key[0]]
        for old in kind[:max(0, len(kind) + 1 - LEARNED_KEPT)]:
            del self.state[old]
        self.state[key] = value
        return value

    def prefix_store(self, which: str, kv_dtype: str = "model"):
        """The prefix.PrefixStore of ``"target"`` or ``"draft"`` caches in ``kv_dtype``, or None when
        prefix caching is off."""
        if self.prefix_cache_bytes <= 0:
            return None
        from .prefix import PrefixStore

        key = ("prefix", which, kv_dtype)
        if key not in self.state:
            self.state[key] = PrefixStore(self.prefix_cache_bytes)
        store = self.state[key]
        store.max_bytes = self.prefix_cache_bytes
        return store

    def forget_prefixes(self) -> None:
        """Empty the prefix stores (benchmarks decode the same prompts once per method: each
        method's run starts as a fresh job would)."""
        for key in [k for k in self.state if isinstance(k, tuple) and k[0] == "prefix"]:
            self.state.pop(key).clear()  # (unlinked: freed now, not at the next cyclic collection)

    def runner(self, which: str):
        """The callable the engine runs for ``"target"`` or ``"draft"`` (same weights either way).

        Runners take the engine's compact :class:`~dynatree.runtime.KeyMask` as ``attention_mask``, and
        ``forward(seqs)`` scores several sequences (runtime.py)."""
        model = getattr(self, which)
        if model is None:
            return None
        with self.lock:
            return self._runner(model, which)

    def _runner(self, model, which: str):
        from . import packed
        from .packed import PackedRunner
        from .lean import LeanNeoX, supports as lean_supports

        key = (self.kernel, which)
        if key not in self.state:
            gem = self.kernel in NATIVE_KERNELS
            cls = None if self.kernel == "hf" else LeanNeoX if lean_supports(model) else (
                PackedRunner if packed.supports(model) else None)  # Llama-family models pack too
            if cls is None and self.kernel == "lean-bf16":  # (a Mistral's window was called "neither GPT-NeoX nor ...")
                why = native_refusal(model.config) or f"a {model.config.model_type} layout it does not pack"
                raise PairError(f"--kernel lean-bf16 runs on dynatree's native kernel, which does not take the {which} "
                                f"model ({why})")
            if cls is None:  # transformers' forward
                run = HFRunner(model)
                run.tree_problem, run.tree_fails = _tree_problem(run, model, which)  # (a PairError: no runner kept)
                run.batch_problem, run.joined_problem = _batch_problems(run, model)
                self.state[key] = run
                return run
            release = self.release_packed and gem and model.device.type == "cpu"  # (native runs only there)
            twin = _twin(cls, model) if release else None  # (taken before `run` frees the weights it reads)
            bf16 = self.kernel == "lean-bf16"
            run = cls(model, gemm=gem, release=release, compute="bfloat16" if bf16 else "float32")
            if bf16 and not run.native:
                raise PairError(f"--kernel lean-bf16 runs on dynatree's native kernel, which cannot run the {which} "
                                f"model: {run.refusal}")
            self.state[key] = _probed(run, model, which, twin or _twin(cls, model), bf16) if run.native else run
        return self.state[key]

    def release_matrices(self) -> int:
        """Free both models' float32 matrices that the native kernel keeps packed copies of
        (cmodel.Runner.release_matrices; a job's actors, once warmed up); the bytes freed."""
        runs = [self.runner(w) for w in ("target", "draft") if getattr(self, w) is not None]
        freed = sum(r.release_matrices() for r in runs if hasattr(r, "release_matrices"))
        release_freed_memory()
        return freed

    def not_native(self, which: str = "target") -> str:
        """Why ``which`` model's forward is not dynatree's native kernel ("" when it is, or no model)."""
        run = self.runner(which)
        if run is None or getattr(run, "native", False):
            return ""
        if hasattr(run, "native"):  # dynatree's forward on torch's ops
            return run.refusal
        if self.kernel == "hf":  # models.HFRunner
            return "transformers' forward (--kernel hf)"
        if run.window is not None:
            return f"transformers' forward (the model's {run.window}-token sliding attention window)"
        from .packed import FAMILY

        if run.config.model_type in FAMILY:
            return f"transformers' forward (a {run.config.model_type} layout the packed forward does not take)"
        return f"transformers' forward ({run.config.model_type} is neither GPT-NeoX nor Llama-family)"

    def forward_in_use(self, which: str = "target") -> str:
        """What runs ``which`` model's forward, for logs and summaries: dynatree's native kernel
        (and its instruction set), torch's ops (and why not the native kernel) or transformers'."""
        run = self.runner(which)
        if run is None:
            return "none"
        if getattr(run, "native", False):
            from . import native

            lib = native.library()
            bf16 = f", bfloat16 compute on {native.bf16_compute(lib)}" if run.weight_format == native.BF16_COMPUTE else ""
            return f"native kernel ({lib.dt_isa().decode()}{bf16})"
        why = self.not_native(which)
        if hasattr(run, "native"):  # dynatree's forward on torch's ops
            return f"torch ops (not the native kernel: {why})"
        if run.tree_problem:  # models.HFRunner: how it takes trees, and batches
            role = ("token trees verified as chains" if which == "target" else
                    "it drafts chains only: methods that grow trees are refused" if run.tree_fails else
                    "its token trees' proposals inexact (outputs are not: the target verifies them)")
            why += f"; {role} ({run.tree_problem})"
        return why + "; " + batch_paths(run)

    def window(self, cfg, which: str = "target"):
        """The kvcache.Window of a method config's ``kv_window`` for ``"target"`` or ``"draft"``
        (None when the window is off); built once per model and setting."""
        if not getattr(cfg, "kv_window", 0):
            return None
        key = ("window", which, cfg.kv_window, cfg.kv_sinks, cfg.kv_evict)
        if key not in self.state:
            from .kvcache import make_window

            self.state[key] = make_window(getattr(self, which), cfg.kv_window, cfg.kv_sinks, cfg.kv_evict)
        return self.state[key]

    def method_problem(self, cfg) -> str:
        """Why this pair cannot decode with method config ``cfg`` ("" when it can): a draft whose
        tree forward fails (models._tree_problem) grows chains only, so only ``linear`` drafts with
        it.  Checked before any decoding: check, bench, a job's actors, BatchDecoder.add."""
        from .config import NATIVE_ROWS, grows_trees, within_native_rows

        if self.kernel == "lean-bf16" and not within_native_rows(cfg):
            return (f"--kernel lean-bf16 computes on the native kernel only, which verifies at most {NATIVE_ROWS} "
                    "tokens a forward: lower the node budget or the lookup length")
        if self.draft is None or not grows_trees(cfg):
            return ""
        draft = self.runner("draft")
        if not getattr(draft, "tree_fails", False):
            return ""
        return (f"the draft model cannot expand token trees on transformers' forward ({draft.tree_problem}): "
                "use method linear, or another draft")

    def need_draft(self, drafted: list) -> None:
        """Before any decoding (check, bench): a ValueError naming the labelled methods that draft
        when the pair was loaded without a draft."""
        if drafted and self.draft is None:
            raise ValueError(f"{', '.join(drafted)} need{'s' if len(drafted) == 1 else ''} a draft model: "
                             "give --draft with --target")

    def decodable(self, cfgs: dict, note) -> dict:
        """``cfgs`` without the methods this pair cannot decode (method_problem), each one dropped
        named through ``note``; a ValueError when none is left (`dynatree check` runs the rest)."""
        problems = {label: self.method_problem(cfg) for label, cfg in cfgs.items()}
        bad = {label: why for label, why in problems.items() if why}
        if bad and len(bad) == len(cfgs):
            whys = set(bad.values())
            raise ValueError(f"{', '.join(bad)}: {whys.pop()}" if len(whys) == 1 else
                             "; ".join(f"{label}: {why}" for label, why in bad.items()))
        for label, why in bad.items():
            note(f"note: skipping {label}: {why}")
        return {label: cfg for label, cfg in cfgs.items() if label not in bad}

    def check_methods(self, cfgs: dict) -> None:
        """Before any decoding (check, bench): each labelled method config's cache window fits the
        context and the models take it (config.check_windows), and the pair can decode it
        (method_problem); a ValueError naming the label otherwise."""
        from .config import check_windows

        check_windows(cfgs, self.window_limit, self.windows)
        for label, cfg in cfgs.items():
            problem = self.method_problem(cfg)
            if problem:
                raise ValueError(f"{label}: {problem}")

    def windows(self, cfg) -> None:
        """Build ``cfg``'s cache windows now (the draft's where the method drafts): a model that
        takes none raises its ValueError before any decoding (check, bench)."""
        from .policies import make_policy

        self.window(cfg, "target")
        if self.draft is not None and make_policy(cfg).needs_draft:
            self.window(cfg, "draft")

    @property
    def leading_ids(self) -> list[int]:
        """The special tokens the tokenizer puts before a text (a Llama tokenizer's BOS; none for
        GPT-NeoX's): a prompt starts with them, as ``tokenizer(text)`` and vLLM's prompts do.  Those
        it puts after one (an EOS some set to add) are left out: the text goes on from there."""
        if "leading_ids" not in self.state:  # (with their text, which a text rendered with them starts with)
            plain = self.tokenizer("a b", add_special_tokens=False)["input_ids"]
            full = self.tokenizer("a b")["input_ids"]
            at = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), 0)
            lead = list(full[:at])
            self.state["leading_ids"] = lead, self.tokenizer.decode(lead) if lead else ""
        return self.state["leading_ids"][0]

    def encode(self, text: str, last: int | None = None, specials: bool = True) -> list[int]:
        """The text's token ids after the tokenizer's leading special tokens (``leading_ids``;
        ``specials=False``: without them); ``last``: at most ``last`` ids, the leading ones and the
        text's last tokens -- a long text's tokenized from its end (_encode_tail)."""
        if self.tokenizer is None:
            raise PairError(f"this pair has no tokenizer (none was given, or the target's directory has none of "
                            f"{', '.join(TOKENIZER_FILES)}): copy the tokenizer files into the target's directory "
                            "(the draft's, where it has them: the two share one), or, in Python, pass token ids")
        if not isinstance(text, str):
            raise PairError(f"a prompt must be text (str), not {type(text).__name__}")
        try:
            text.encode("utf-8")  # (a command line's or a pipe's bad bytes arrive as lone surrogates)
        except UnicodeEncodeError as e:
            raise PairError(f"the prompt is not valid UTF-8 text (at character {e.start})") from None
        lead = self.leading_ids if specials else []
        if lead and text.startswith(self.state["leading_ids"][1]):  # (a text rendered with its BOS: not twice)
            lead = []
        if last and last <= len(lead):  # (no room for the text after them: its last tokens alone)
            lead = []
        keep = last - len(lead) if last else None
        tail = self._encode_tail(text, keep) if keep else None
        ids = tail if tail is not None else self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return lead + (ids[-keep:] if keep else ids)

    def _encode_tail(self, text: str, last: int) -> list[int] | None:
        """The last ``last`` tokens of a long text's ids, read from suffixes of the text: a
        tokenizer's pieces depend on nearby text only, so past a cut at a word boundary (a space
        between two letters, where every pre-tokenizer splits) a suffix's tokens are the whole
        text's.  Taken where two such suffixes (about n and 4n characters, each at least 2 * ``last``
        tokens) end in the same ``last`` tokens; None (tokenize it whole) where none do before the
        suffix would be a quarter of the text.  A cut at a fixed length could land inside a long
        run of one character (padding spaces, blank lines) at the same phase for both suffixes and
        split it unlike the whole text.  (A 40 MB prompt took a minute to tokenize whole for the
        512 tokens a job keeps, stalling its actor's batch.)"""
        n, seen = TAIL_CHARS_PER_TOKEN * last, None
        if 16 * n > len(text):  # (no room for two suffixes: one would only add to the whole's cost)
            return None
        while 4 * n <= len(text):
            cut = _word_boundary(text, len(text) - n, n)
            ids = self.tokenizer(text[cut:], add_special_tokens=False)["input_ids"] if cut is not None else []
            if len(ids) >= 2 * last:
                if ids[-last:] == seen:
                    return seen
                seen = ids[-last:]
            n *= 4
        return None

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode_chat(self, messages: str | list[dict]) -> list[int]:
        """A conversation ([{"role": ..., "content": ...}, ...], or a string: one user message)
        rendered with the tokenizer's chat template, the assistant's turn opened (the template
        writes any special tokens itself).  PairError (a ValueError) if there is no template, or
        it refuses the conversation."""
        messages = chat_messages(messages)
        if not self.has_chat_template:
            raise PairError("the target's tokenizer has no chat template")
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - jinja2's TemplateError (raise_exception: roles must
            # alternate, ...) or whatever a template trips on: this conversation's problem, not the job's
            raise PairError(f"the chat template refused this conversation: {e}") from e
        return self.encode(text, specials=False)  # (a template writes its BOS into the text)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _seam(self, ids: list[int]) -> list[int]:
        """The prompt's last tokens to decode a continuation after: at least _SEAM_TOKENS, starting on
        a whole character -- a byte-fallback decoder turns a run of byte tokens that starts inside
        one into U+FFFDs, the continuation's bytes with it ("ok 😀€" went on "��tern": the text
        trial); none where no such start is near (the continuation is then decoded alone)."""
        for n in range(_SEAM_TOKENS, _SEAM_TOKENS + 8):
            if "\ufffd" not in self.decode(ids[-n:]):
                return ids[-n:]
            if n >= len(ids):
                break
        return []

    def decoder(self, prompt) -> Callable[[list[int]], str]:
        """The decode of tokens that continue ``prompt`` (its ids): decoded after the prompt's last
        few tokens, less those tokens' own text, as vLLM's detokenizer does.  A SentencePiece decoder
        (Llama 2, Mistral, TinyLlama) drops the leading space of ids decoded alone: "▁the ▁man" read
        "the man" after "Once upon a time", and a stop string " the" never fired (the text trial).
        Where the prompt's text does not begin the joint text (a prompt ending inside a character,
        or a decoder's clean-up across the seam), the ids' own decode, as before."""
        ids = prompt.reshape(-1).tolist() if hasattr(prompt, "reshape") else list(prompt)  # (a (1, n) tensor too)
        tail = self._seam([int(t) for t in ids]) if self.tokenizer is not None else []
        if not tail:
            return self.decode
        head = self.decode(tail)

        def decode(ids: list[int]) -> str:
            both = self.decode(tail + list(ids))
            return both[len(head):] if both.startswith(head) else self.decode(ids)
        return decode


def is_chat(prompt) -> bool:
    """Whether a prompt is chat messages (a list of mappings), not text or token ids."""
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and isinstance(prompt[0], dict)


def conversation(text: str) -> str | list:
    """A chat prompt given as text: JSON meant as messages -- a list that is empty or holds an
    object, or one object with a "role" or "content" -- is that conversation (refused unless {role,
    content} messages: '[]' and '{"role": ...}' went to the model as text, '[{"role": "user"}]'
    was refused); any other text (a list of numbers, '[not json]') one user message.  The same for
    `generate --chat-template` and a job's string cells (which went to the model as a user message
    holding the JSON: the chat trial)."""
    if text.lstrip()[:1] in ("[", "{"):
        try:
            value = json.loads(text)
        except ValueError:
            return text
        if isinstance(value, dict) and ("role" in value or "content" in value):
            return [value]
        if isinstance(value, list) and (not value or any(isinstance(m, dict) for m in value)):
            return value
    return text


def chat_messages(value) -> list[dict]:
    """A prompt as chat messages: a string is its :func:`conversation` (JSON messages, else one user
    message), a mapping one message; otherwise each a mapping with string ``role`` and ``content``
    (other keys dropped, so a Parquet struct's nulls do not reach the template); ValueError otherwise."""
    if isinstance(value, str):
        value = conversation(value)
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, dict):  # one message (a JSONL object, a struct value): a conversation of one
        value = [value]
    if not isinstance(value, (list, tuple)) or not value or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value):
        empty = " (an empty conversation)" if isinstance(value, (list, tuple)) and not value else ""
        raise ValueError(f"prompt is not a list of {{role, content}} messages with string values{empty}")
    if not any(m["content"].strip() for m in value):  # (as a text prompt: a blank one is an input's mistake)
        raise ValueError("prompt's messages are all empty or only whitespace")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _logit_width(model) -> int:
    out = model.get_output_embeddings()
    return int(out.weight.shape[0]) if out is not None else int(model.config.vocab_size)


def _context_len(model) -> int:
    return context_len(model.config)


def tokenizer_difference(a, b) -> str | None:
    """None when equal, else a one-line reason."""
    va, vb = a.get_vocab(), b.get_vocab()
    if len(va) != len(vb):
        return f"vocabulary sizes differ ({len(va)} vs {len(vb)})"
    if va != vb:
        diff = next(t for t in sorted(va) if vb.get(t) != va[t])
        return f"token {diff!r} has id {va[diff]} in the target but {vb.get(diff)} in the draft"
    probe = "The quick brown fox, 1919: naïve café — ‘quoted’.\n"
    if a(probe)["input_ids"] != b(probe)["input_ids"]:
        return "the two tokenizers split the same text differently"
    return None


def cpu_layout(model) -> None:
    """Store every Linear weight as the transpose of an (in, out) contiguous matrix, in place.

    Same values, same module API; only the memory layout changes.  With it, ``F.linear`` runs
    ``x @ W_t`` on a contiguous (in, out) matrix, which MKL does 2-4x faster than the (out, in)
    layout for the few-row inputs of decoding and tree verification (measured on this project's
    CPU: a 512x2048 layer at 16 rows, 1.1 ms -> 0.23 ms).  GPUs don't need it.
    """
    # a Linear tied to an embedding (an LM head sharing its matrix) keeps the embedding's row layout:
    # transposed, the lookup's rows would be strided and the native kernel would need a dense copy
    for mod in untied_linears(model):
        if mod.weight.is_contiguous():
            mod.weight.data = mod.weight.data.t().contiguous().t()


def _slow_on_cpu(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why a model of ``dtype`` on ``device`` runs slowly (config.SLOW_ON_CPU), or None."""
    return SLOW_ON_CPU.get(str(dtype).removeprefix("torch.")) if device.type == "cpu" else None


def pair_from_models(target, draft, tokenizer=None, *, draft_tokenizer=None,
                     eos_token_id: int | list[int] | None = None, names: dict | None = None,
                     kernel: str = "lean") -> ModelPair:
    """Wrap already-loaded models; checks vocabulary compatibility."""
    if kernel not in KERNELS:
        raise PairError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    if tokenizer is not None and draft_tokenizer is not None:
        reason = tokenizer_difference(tokenizer, draft_tokenizer)
        if reason:
            raise PairError(f"target and draft do not share a tokenizer: {reason}")
    wt = _logit_width(target)
    vocab = wt
    if draft is not None:
        wd = _logit_width(draft)
        vocab = min(wt, wd)
        n_tok = len(tokenizer) if tokenizer is not None else None
        if n_tok is not None and n_tok > vocab:
            who = "target and draft score" if wt == wd else f"the {'draft' if wd < wt else 'target'} scores"
            raise PairError(
                f"the tokenizer and the models' vocabularies do not match: the tokenizer has {n_tok} tokens but "
                f"{who} only {vocab} (target {wt}, draft {wd} logits)")
        if n_tok is None and wt != wd and abs(wt - wd) > 128:
            raise PairError(f"target and draft vocabularies do not match ({wt} vs {wd} logits)")
    eos_ids = _eos_ids(tokenizer, target, eos_token_id)
    p = next(target.parameters())
    slow = _slow_on_cpu(p.device, p.dtype)
    if slow:  # (said here, not only by load_pair: a model loaded with transformers' default dtype came in bfloat16)
        warnings.warn(slow, stacklevel=2)
    if p.device.type == "cpu":
        for m in (target, draft):
            if m is not None:
                cpu_layout(m)
    ctx = _context_len(target)
    shorter = _context_len(draft) if draft is not None and _context_len(draft) < ctx else 0
    return ModelPair(target, draft, tokenizer, p.device, p.dtype, vocab, ctx, names or {}, kernel=kernel,
                     eos_token_ids=eos_ids, target_vocab=wt, draft_positions=shorter)


def _eos_ids(tokenizer, model, given) -> tuple[int, ...]:
    """The ids that end a generation: ``given`` (an id or a list), else the tokenizer's EOS, the
    model config's and its generation config's ``eos_token_id`` (each an id or a list), as
    transformers' ``generate`` stops at every id of the generation config's list -- a chat model's
    end of turn (Llama 3's <|eot_id|>, Qwen's <|im_end|>) is often only there."""
    sources = [given] if given is not None else [
        getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None,
        getattr(model.config, "eos_token_id", None),
        getattr(getattr(model, "generation_config", None), "eos_token_id", None)]
    ids = []
    for src in sources:
        for i in src if isinstance(src, (list, tuple)) else [src]:
            if isinstance(i, int) and not isinstance(i, bool) and i >= 0 and i not in ids:
                ids.append(i)
    return tuple(ids)


def _attentions() -> set[str]:
    """The attention implementations transformers knows here (its registry: names it adds, and a
    user's AttentionInterface.register, count), or none where it cannot say."""
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return {"eager", "sdpa", *ALL_ATTENTION_FUNCTIONS.valid_keys()}
    except (ImportError, AttributeError):
        return set()


def load_model(name_or_path: str, device: torch.device, dtype: torch.dtype,
               attn_implementation: str = "sdpa", lean: bool = False):
    """Load a causal LM by Hugging Face hub name or local directory.

    ``lean``: the model will only run on the lean kernels, so a local GPT-NeoX checkpoint skips
    transformers' modeling code (checkpoint.py: ~2 s less start-up per process)."""
    from . import checkpoint

    from safetensors import SafetensorError  # a corrupt or truncated weights file

    if lean and checkpoint.readable(name_or_path):
        try:
            return checkpoint.load(name_or_path, dtype, device)
        except (OSError, ValueError, SafetensorError) as e:
            raise PairError(f"cannot load model {name_or_path!r}: {e}") from e
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-tensor "Loading weights" bars drown job output
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                name_or_path, dtype=dtype, attn_implementation=attn_implementation)
        except ValueError as e:  # an architecture without SDPA (BLOOM, GPT-2 variants): its own attention
            if "attention implementation" not in str(e) or attn_implementation == "eager":
                raise
            model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, attn_implementation="eager")
    except (OSError, ValueError, SafetensorError) as e:
        raise PairError(f"cannot load model {name_or_path!r}: {e}") from e
    return model.to(device).eval()


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    if lacks_tokenizer(name_or_path):  # the models still run on token ids; a text prompt says why not (encode)
        return None
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError) as e:
        raise PairError(f"cannot load tokenizer for {name_or_path!r}: {e}") from e
    return tok if len(tok) > 8 else None  # (transformers' empty stand-in where a hub repo has no tokenizer)


def load_pair(target: str | os.PathLike | None = None, draft: str | os.PathLike | None = None, *,
              device: str = "auto", dtype: str = "float32", attn_implementation: str = "sdpa",
              load_draft: bool = True, kernel: str = "lean", transformers_models: bool = False) -> ModelPair:
    """Load a target/draft pair from hub names or local directories.

    With neither given, loads the demo pair bundled with the package.  ``load_draft=False``
    skips the draft (enough for ``ar``).  ``kernel="hf"`` runs transformers' own forward in the
    engine instead of the lean one (lean.py; GPT-NeoX models).  On the lean kernels a local GPT-NeoX
    checkpoint is read without transformers' model classes (checkpoint.py) unless
    ``transformers_models`` (needed to call transformers' ``generate`` on ``pair.target``).
    """
    if target is None and draft is None:
        base = default_pair_dir()
        if not (base / "target").is_dir():
            raise PairError(f"no --target/--draft given and the bundled demo pair is missing ({base})")
        target, draft = str(base / "target"), str(base / "draft")
    if target is None:
        raise PairError("a draft was given without a target")
    for role, name in (("target", target), ("draft", draft if load_draft else None)):
        problem = model_problem(str(name)) if name is not None else None
        if problem:
            raise PairError(f"{role} {name}: {problem}")
    # (lean-bf16 is a CPU kernel: device auto is the CPU for it, on a machine with CUDA too)
    dev, dt = resolve_device("cpu" if kernel == "lean-bf16" and device == "auto" else device), resolve_dtype(dtype)
    if kernel not in KERNELS:  # (before the models load, as a job's spec refuses them)
        raise PairError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    # (the default asks nothing: transformers' registry imports its modeling code, ~1.3 s of every start)
    if attn_implementation not in ("sdpa", "eager") and (known := _attentions()) \
            and attn_implementation not in known and "/" not in str(attn_implementation):
        raise PairError(f"attn_implementation must be one of {', '.join(sorted(known))} (or a hub kernel's "
                        f"org/name), got {attn_implementation!r}")  # (the lean kernels never read it: a typo passed)
    if kernel == "lean-bf16" and (dt != torch.float32 or dev.type != "cpu"):
        raise PairError(f"kernel lean-bf16 is dynatree's CPU kernel computing in bfloat16: it loads the models as "
                        f"float32 on a CPU (dtype float32, device cpu or auto), not {str(dt).removeprefix('torch.')} "
                        f"on {device}")
    slow = _slow_on_cpu(dev, dt)
    if slow:  # (before the load, at the caller's line; pair_from_models, below, would say it after)
        warnings.warn(slow, stacklevel=2)
    tok = load_tokenizer(str(target))
    lean = kernel != "hf" and not transformers_models
    tmodel = load_model(str(target), dev, dt, attn_implementation, lean)
    dmodel = dtok = None
    if draft is not None and load_draft:
        try:
            dtok = load_tokenizer(str(draft))  # (None without tokenizer files: the target's is trusted)
        except PairError:
            dtok = None  # one that fails to load: the target's too (the vocabularies are still compared)
        dmodel = load_model(str(draft), dev, dt, attn_implementation, lean)
    with warnings.catch_warnings():
        if slow:
            warnings.filterwarnings("ignore", message=re.escape(slow))
        return pair_from_models(tmodel, dmodel, tok, draft_tokenizer=dtok, kernel=kernel,
                                names={"target": str(target), "draft": None if dmodel is None else str(draft)})
