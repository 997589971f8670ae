"""What a CPU actor's memory will hold, estimated from its models' files before anything loads.

Why: a CPU actor of a billion-parameter model holds its weights as loaded (float32), the native
kernel's packed copy of its matrices, and every row's key/value caches; the default actor count
(as many as the CPUs hold) and ``--batch-size auto`` (up to ``--max-batch-size`` rows) can ask for
more than the machine has, and then the OS kills actors -- a loop of retries that never says why.
The driver starts only as many actors as the nodes' memory holds and caps ``auto``'s batch so the
caches fit (driver.fit_memory), saying so.  The estimate leans high (every matrix counted in the
packed copy, the prefix cache counted full).

Read from local safetensors checkpoints only (their JSON headers: no weights are read, no torch);
hub names and other formats give no estimate and change nothing.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

RUNTIME_BYTES = 600 * 2**20  # an actor's process before its models: Python, torch, Ray's worker
NATIVE_TYPES = ("gpt_neox", "llama", "mistral", "qwen2", "qwen3")  # what the C kernel runs (lean.py, packed.py)
_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
_STORED16 = ("BF16", "F16")


@dataclass(frozen=True)
class Footprint:
    """Bytes one actor holds: ``base`` whatever its batch, and ``per_row`` for each row in flight."""

    weights: int  # both models as loaded
    packed: int  # the native kernel's copies of their matrices
    fixed: int  # the prefix cache's budget and the process itself
    per_row: int  # a row's key/value caches (target and draft) at the job's longest row
    row_tokens: int  # the tokens a row's caches hold

    @property
    def base(self) -> int:
        return self.weights + self.packed + self.fixed

    def total(self, rows: int) -> int:
        return self.base + rows * self.per_row

    def rows_within(self, budget: float) -> int:
        """Rows whose caches fit in ``budget`` bytes beside the base."""
        return max(0, math.floor((budget - self.base) / self.per_row)) if self.per_row else 1 << 30

    def describe(self) -> str:
        gb = 2**30
        return (f"~{self.base / gb:.1f} GiB for its models ({self.weights / gb:.1f} GiB of weights"
                f"{f' + {self.packed / gb:.1f} GiB packed for the native kernel' if self.packed else ''}, "
                f"{self.fixed / gb:.1f} GiB prefix cache and process) and ~{self.per_row / 2**20:.0f} MiB per row "
                f"in flight (key/value caches of {self.row_tokens} tokens)")


def _header_tensors(model_dir: Path) -> list[tuple[str, list[int]]] | None:
    """(dtype, shape) of every tensor in the directory's safetensors files, from their headers."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    out = []
    for f in files:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            head = json.loads(fh.read(n))
        out += [(v["dtype"], v["shape"]) for k, v in head.items() if k != "__metadata__"]
    return out


def _model(model_dir: Path, dtype: str, native: bool, kv_bytes: int, tokens: int) -> tuple[int, int, int] | None:
    """(weights, packed, per-row cache) bytes of one model, or None without safetensors or config."""
    tensors = _header_tensors(model_dir)
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not tensors:
        return None
    params = sum(math.prod(s) for _, s in tensors)
    mats = sum(math.prod(s) for _, s in tensors if len(s) == 2)
    packs = native and cfg.get("model_type") in NATIVE_TYPES
    packed = mats * (2 if all(d in _STORED16 for d, _ in tensors) else 4) if packs else 0
    heads = cfg.get("num_attention_heads") or 1
    head_dim = cfg.get("head_dim") or (cfg.get("hidden_size") or 0) // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    per_row = (cfg.get("num_hidden_layers") or 0) * 2 * kv_heads * head_dim * kv_bytes * tokens
    return params * _BYTES.get(dtype, 4), packed, per_row


def estimate(spec, dirs: list[Path], context: int | None) -> Footprint | None:
    """One CPU actor's footprint for this job (``spec``: jobs.spec.JobSpec; ``dirs``: the local
    model directories it loads; ``context``: the models' context), or None where unknown."""
    cfg = spec.method_config
    window = getattr(cfg, "kv_window", 0)
    tokens = min(spec.max_prompt_tokens + spec.max_new_tokens, context or 1 << 30)
    tokens = (min(tokens, window) if window else tokens) + 64  # the engine's room for a tree
    kv_bytes = 2 if getattr(cfg, "kv_dtype", "model") == "bfloat16" else _BYTES.get(spec.dtype, 4)
    native = spec.kernel == "lean" and spec.dtype == "float32"
    parts = [_model(d, spec.dtype, native, kv_bytes, tokens) for d in dirs]
    if not parts or any(p is None for p in parts):
        return None
    weights, packed, per_row = (sum(p[i] for p in parts) for i in range(3))
    return Footprint(weights, packed, int(spec.prefix_cache_gb * 2**30) + RUNTIME_BYTES, per_row, tokens)


HEADROOM = 0.9  # of a node's memory the actors may fill (Ray's OOM killer acts at 95% used)


def _node_bytes(node: dict) -> float:
    """A Ray node's memory for tasks and its object store: what was free when it started."""
    res = node.get("Resources", {})
    return HEADROOM * (res.get("memory", 0) + res.get("object_store_memory", 0))


def fit(fp: Footprint, nodes: list[dict], n: int, cpus: float, spec) -> tuple[int, int | None, list[str]]:
    """Actors to start and the batch cap for ``auto`` (None: no cap) so that ``n`` actors of ``cpus``
    CPUs each (``spec.num_actors`` None: ``n`` is as many as the CPUs hold) fit the alive nodes'
    memory by ``fp``; with what to tell the user.  Nodes fill in order, as many actors each as its
    CPUs hold (a PACK placement group)."""
    fixed = None if spec.batch_size == "auto" else int(spec.batch_size)
    alive = [x for x in nodes if x.get("Alive", x.get("alive", True))]
    slots = [(int(x.get("Resources", {}).get("CPU", 0) // cpus), _node_bytes(x)) for x in alive]
    room = sum(min(c, int(mem // fp.total(fixed or 1))) for c, mem in slots)
    notes = []
    if spec.num_actors is None and room < n:
        notes.append(f"starting {max(room, 1)} actor(s), not the {n} the CPUs hold (--num-actors or "
                     "--memory-per-actor overrides)")
        n = max(room, 1)
    elif room < n:
        notes.append(f"warning: the {n} actor(s) asked for may not fit (room for {room}); an actor the OS kills is "
                     "retried, then its shards fail")
    share, left = math.inf, n
    for c, mem in slots:  # the tightest node's memory per actor
        here = min(c, left)
        if here:
            share, left = min(share, mem / here), left - here
    rows = fp.rows_within(share) if share < math.inf else 1 << 30
    cap = None
    if fp.total(1) > share:
        notes.append(f"warning: even one row may not fit ({share / 2**30:.1f} GiB per actor)")
    if fixed is None and rows < spec.max_batch_size:
        cap = max(rows, 1)
        notes.append(f"--batch-size auto capped at {cap} row(s) per actor (--max-batch-size {spec.max_batch_size})")
    elif fixed is not None and rows < fixed:
        notes.append(f"warning: --batch-size {fixed} may not fit (room for {rows} row(s) per actor; a smaller batch, "
                     "--max-prompt-tokens or --option kv_dtype=bfloat16 needs less)")
    if notes:
        notes = [f"memory: each actor needs {fp.describe()}, estimated from the checkpoints; " + "; ".join(notes)]
    return n, cap, notes
