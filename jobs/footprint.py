"""What a CPU actor's memory will hold, estimated from its models' files before anything loads.

Why: a CPU actor of a billion-parameter model holds its weights as loaded (float32), a packed copy
of its matrices (the native kernel's, or oneDNN's on torch's path), and every row's key/value
caches; the default actor count (as many as the CPUs hold) and ``--batch-size auto`` (up to
``--max-batch-size`` rows) can ask for more than the machine has, and then the OS kills actors --
a loop of retries that never says why.  Where memory binds, the driver reserves an actor's load
peak as Ray's memory resource, so Ray starts no more actors on a node than it holds (:func:`fit`,
the driver's ``_Dispatch._fit_memory``), and says so; each actor, once loaded, caps ``auto``'s
batch at the rows that fit its share of the node beside what it measurably holds (:func:`rows_for`,
actors/worker.py) -- the estimate's own cap only informs.

Counted: what the engine allocates by design -- weights, packed copies, one prefix store per model
at its full budget, per row the caches at their allocated length and a full tree's logits -- and
RUNTIME_BYTES for the process.  Not counted: torch's transient buffers.  Read from local
safetensors checkpoints (their JSON headers: no weights are read, no torch); hub names, other
formats and configs without the usual size keys give no estimate and change nothing.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from dynatree.config import (MAX_PACKED_BYTES, MKL_PACK_BYTES, NATIVE_FAMILIES, NATIVE_KERNELS, cache_rows,
                             within_native_rows)
from dynatree.names import SKIP, safetensors_files

from . import placement

# An actor's process before its models: a Ray worker that has imported torch, transformers and
# dynatree holds 314 MiB (RSS, the project's host, 2026-11-25); the rest covers what loading adds.
RUNTIME_BYTES = 600 * 2**20
HEADROOM = 0.9  # of a node's free memory the actors may fill (Ray's OOM killer acts at 95% used)
_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
_FLOATS = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2}
_EMBEDDINGS = ("embed_in", "embed_tokens", "wte", "word_embeddings")  # input embeddings: the kernel reads them
_KEYS = {"layers": ("num_hidden_layers", "n_layer", "num_layers"), "heads": ("num_attention_heads", "n_head"),
         "hidden": ("hidden_size", "n_embd", "d_model")}


@dataclass(frozen=True)
class Footprint:
    """Bytes one actor holds: ``base`` whatever its batch, and ``per_row`` for each row in flight."""

    weights: int  # the models as loaded
    packed: int  # packed copies of their matrices
    fixed: int  # prefix stores at their budget, and the process itself
    per_row: int  # a row's key/value caches (target and draft) and a full tree's logits
    row_tokens: int  # the slots a row's caches are allocated with
    released: int = 0  # weights freed as the native kernel packs them (cmodel.Runner.packed_callback)
    prefix: int = 0  # of ``fixed``: the prefix stores' budget (--prefix-cache-gb, a store per model)

    @property
    def base(self) -> int:
        """At load, before any row: the weights, and beside them the packed copies -- or, where each
        matrix is freed as it is packed, only what the copies outgrow the freed matrices by."""
        return self.weights + self.fixed + max(0, self.packed - self.released)

    @property
    def loaded(self) -> int:
        """Once loaded, before any row."""
        return self.weights + self.packed + self.fixed - self.released

    def total(self, rows: int) -> int:
        return max(self.base, self.loaded + rows * self.per_row)

    def rows_within(self, budget: float) -> int:
        """Rows whose caches fit in ``budget`` bytes (none if the load does not)."""
        if budget < self.base:
            return 0
        return math.floor((budget - self.loaded) / self.per_row) if self.per_row else 1 << 30

    def less(self, spec) -> str:
        """The flags that would leave room, where rows do not fit: the prefix stores' budget first
        when it is the biggest part of what the actor holds (trial AE: a 1.5 GiB node capped at one
        row by 2 GiB of prefix budget, which fills only with shared prompt beginnings)."""
        bf16 = "" if getattr(spec.method_config, "kv_dtype", "model") == "bfloat16" else ", or --option kv_dtype=bfloat16"
        said = f"a smaller batch or --max-prompt-tokens needs less{bf16}"
        if self.prefix and self.prefix >= max(self.weights, self.per_row):
            said = (f"--prefix-cache-gb {spec.prefix_cache_gb:g} counts {self.prefix / 2**30:.1f} GiB for stores that "
                    "fill only with prompt beginnings rows share (a smaller one, or 0, leaves room); " + said)
        return said

    def describe(self) -> str:
        gb = 2**30
        freed = (f"; {self.released / gb:.1f} GiB freed as they are packed, ~{self.loaded / gb:.1f} GiB once loaded"
                 if self.released else "")
        return (f"~{self.base / gb:.1f} GiB before its rows ({self.weights / gb:.1f} GiB of weights"
                f"{f', {self.packed / gb:.1f} GiB packed copies' if self.packed else ''}, {self.fixed / gb:.1f} GiB "
                f"prefix cache and process{freed}) and ~{self.per_row / 2**20:.0f} MiB per row in flight (caches of "
                f"{self.row_tokens} tokens)")


def _header_tensors(model_dir: Path) -> list[tuple[str, str, list[int]]] | None:
    """(name, dtype, shape) of the floating-point tensors a loader reads, from the safetensors headers."""
    files = safetensors_files(model_dir)
    if not files:
        return None
    out = []
    for f in files:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            head = json.loads(fh.read(n))
        out += [(k, v["dtype"], v["shape"]) for k, v in head.items()
                if k != "__metadata__" and v["dtype"] in _FLOATS and not k.endswith(SKIP)]
    return out


def _size(cfg: dict, key: str) -> int | None:
    return next((cfg[k] for k in _KEYS[key] if isinstance(cfg.get(k), int) and cfg[k] > 0), None)


def _model(model_dir: Path, spec, kv_bytes: int, slots: int) -> tuple[int, int, int, int] | None:
    """(weights, packed copies, weights freed once packed, per-row) bytes of one model, or None
    where unknown."""
    tensors = _header_tensors(model_dir)
    try:
        top = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    cfg = top.get("text_config") or top
    layers, heads, hidden = (_size(cfg, k) for k in ("layers", "heads", "hidden"))
    if not tensors or not (layers and heads and hidden):
        return None
    per_weight = _BYTES.get(spec.dtype, 4)
    weights = sum(math.prod(s) for _, _, s in tensors) * per_weight
    mats = [(k, d, math.prod(s)) for k, d, s in tensors if len(s) == 2]
    n_mats = sum(n for _, _, n in mats)
    ours = top.get("model_type") in NATIVE_FAMILIES and spec.kernel != "hf" and spec.dtype == "float32"
    packed = released = 0
    if ours and spec.kernel in NATIVE_KERNELS:  # the native kernel's copy, 16-bit where one such format stores them all
        sixteen = spec.kernel == "lean-bf16" or len({d for _, d, _ in mats}) == 1 and mats[0][1] in ("BF16", "F16")
        packed = n_mats * (2 if sixteen else 4)
        if packed > MAX_PACKED_BYTES:  # the kernel refuses it: torch's path, nothing packed or freed
            packed = 0
        elif within_native_rows(spec.method_config):  # (the actors free torch's weights as packed: actors/worker.py)
            released = sum(n for k, _, n in mats if not any(e in k for e in _EMBEDDINGS)) * per_weight
    neox = top.get("model_type") == "gpt_neox"  # (only lean.LeanNeoX's torch path keeps a oneDNN copy)
    if not packed and ours and neox and MKL_PACK_BYTES[0] <= weights <= MKL_PACK_BYTES[1]:  # lean.can_pack
        packed = n_mats * 4
    return weights, packed, released, row_bytes(top, spec.method_config, kv_bytes, slots)


def row_bytes(config: dict, method, kv_bytes: int, slots: int) -> int | None:
    """A row's key/value caches of ``slots`` slots in one model (``config``: its config.json) and a
    full tree's logits: what a row in flight holds (the driver's estimate, an actor's own cap)."""
    cfg = config.get("text_config") or config
    layers, heads, hidden = (_size(cfg, k) for k in ("layers", "heads", "hidden"))
    if not (layers and heads and hidden):
        return None
    kv_heads = cfg.get("num_key_value_heads") or cfg.get("num_kv_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    tree = max(method.node_budget, 1) + 1  # (its logits: at most config.MAX_TREE_NODES of them)
    return layers * 2 * kv_heads * head_dim * kv_bytes * slots + tree * (cfg.get("vocab_size") or 0) * 4


def _slots(spec, context: int | None) -> tuple[int, int]:
    """(the slots a row's caches get, bytes per cached value) for this job."""
    cfg = spec.method_config
    context = context or 1 << 30
    prompt = spec.max_prompt_tokens if spec.max_prompt_tokens is not None else context
    kv_bytes = 2 if getattr(cfg, "kv_dtype", "model") == "bfloat16" else _BYTES.get(spec.dtype, 4)
    return cache_rows(cfg, prompt + spec.max_new_tokens, context), kv_bytes


def _prefix_bytes(spec, models: int) -> int:
    """The prefix stores' budget: one per model (models.ModelPair.prefix_store), none where the
    method's prefix_cache option turns them off (they were counted anyway: trial AM)."""
    if not getattr(spec.method_config, "prefix_cache", True):
        return 0
    return int(spec.prefix_cache_gb * 2**30) * models


def estimate(spec, dirs: list[Path], context: int | None) -> Footprint | None:
    """One CPU actor's footprint for this job (``spec``: jobs.spec.JobSpec; ``dirs``: the local
    model directories it loads; ``context``: the models' context), or None where unknown."""
    slots, kv_bytes = _slots(spec, context)
    parts = [_model(d, spec, kv_bytes, slots) for d in dirs]
    if not parts or any(p is None or p[3] is None for p in parts):
        return None
    weights, packed, released, per_row = (sum(p[i] for p in parts) for i in range(4))
    prefix = _prefix_bytes(spec, len(dirs))
    return Footprint(weights, packed, prefix + RUNTIME_BYTES, per_row, slots, released, prefix)


def rows_for(spec, configs: list[dict], context: int, share: float, rss: float) -> tuple[int, int] | None:
    """An actor's own batch cap, once loaded (actors/worker.py): the rows whose caches fit in its
    ``share`` of the node's memory beside what it holds now (``rss``) and its prefix stores' budget
    -- measured, so that a model the kernel did not take (nothing packed, nothing freed) or memory
    the allocator kept is counted as it is.  (rows, bytes per row), or None where unknown."""
    slots, kv_bytes = _slots(spec, context)
    sizes = [row_bytes(c, spec.method_config, kv_bytes, slots) for c in configs]
    if not sizes or None in sizes or not sum(sizes):
        return None
    prefix = _prefix_bytes(spec, len(configs))
    return max(0, math.floor((share - rss - prefix) / sum(sizes))), sum(sizes)


def _free(node: dict) -> float:
    """A Ray node's memory for tasks and its object store: what was free when it started."""
    res = node.get("Resources", {})
    return HEADROOM * (res.get("memory", 0) + res.get("object_store_memory", 0))


class Fit(NamedTuple):
    actors: int
    reserve: float | None  # bytes each actor reserves as Ray's memory resource (None: none)
    cap: int | None  # the estimate's batch cap for auto (None: none); each actor measures its own
    share: float  # bytes of a node's memory per actor where they are tightest
    notes: list


def fit(fp: Footprint, nodes: list[dict], n: int, cpus: float, spec) -> Fit:
    """How to start ``n`` actors of ``cpus`` CPUs (``spec.num_actors`` None: ``n`` is as many as the
    CPUs hold) within the alive nodes' memory by ``fp``, and what to tell the user.

    Where memory binds (a node that Ray may fill by CPU cannot hold that many), each actor reserves
    its base and smallest batch as Ray's memory resource, so that Ray places actors by memory too;
    where no node's Ray memory resource (~70% of what was free: the object store is the rest)
    holds one, nothing is reserved and one actor starts.  An explicit --num-actors is kept, with a
    warning.  The cap prices the tightest node, filled as far as its CPUs (and reservations)
    allow: Ray, not the driver, chooses where each actor goes."""
    fixed = None if spec.batch_size == "auto" else int(spec.batch_size)
    need = fp.total(fixed or 1)
    alive = placement._alive(nodes)
    notes, reserve = [], None
    custom = spec.resources_per_actor  # (only nodes that offer them hold actors)
    shape = placement._wanted(placement._shape(cpus, 0, None, custom))
    cpu_fit = [placement._node_fits(x.get("Resources", {}), shape) for x in alive]
    mem_fit = [min(c, int(_free(x) // need)) for c, x in zip(cpu_fit, alive)]
    binding = any(m < min(c, n) for c, m in zip(cpu_fit, mem_fit))  # a node Ray may fill by CPU cannot hold it
    if spec.num_actors is not None or not binding:
        if binding:
            notes.append(f"warning: the {n} actor(s) asked for may not fit (room for {sum(mem_fit)}); an actor the OS "
                         "kills is retried, then its shards fail")
        per_node = [min(c, n) for c in cpu_fit]
    elif any(x.get("Resources", {}).get("memory", 0) >= need for x in alive):
        reserve = float(need)
        room = placement.feasible_actors(nodes, cpus, 0, reserve, custom)
        if room < n:
            notes.append(f"starting {room} actor(s), not the {n} the CPUs hold (--num-actors or --memory-per-actor "
                         "overrides)")
            n = room
        per_node = [min(c, int(x["Resources"]["memory"] // need), n) for c, x in zip(cpu_fit, alive)]
    else:
        if n > 1:
            notes.append(f"starting 1 actor, not {n}: no node's Ray memory resource holds one (--num-actors or "
                         "--memory-per-actor overrides)")
        n, per_node = 1, [min(c, 1) for c in cpu_fit]
    share = min((_free(x) / k for k, x in zip(per_node, alive) if k), default=math.inf)
    rows = fp.rows_within(share) if share < math.inf else 1 << 30
    cap = None
    if fp.total(1) > share:
        notes.append(f"warning: even one row may not fit ({share / 2**30:.1f} GiB per actor; {fp.less(spec)})")
    if fixed is None and rows < spec.max_batch_size:
        cap = max(rows, 1)
        notes.append(f"--batch-size auto capped near {cap} row(s) per actor (--max-batch-size {spec.max_batch_size}; "
                     "each actor measures its own once loaded)")
    elif fixed is not None and rows < fixed:
        notes.append(f"warning: --batch-size {fixed} may not fit (room for {rows} row(s) per actor; {fp.less(spec)})")
    if notes:
        notes = [f"memory: each actor needs {fp.describe()}, estimated from the checkpoints; " + "; ".join(notes)]
    return Fit(n, reserve, cap, share, notes)
