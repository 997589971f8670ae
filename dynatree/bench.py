"""``dynatree bench``: the paper's protocol, every method and transformers' peers in one process.

Protocol: N prompts per dataset, the first W discarded as warm-up, mean ± std over the rest;
every method on the same prompts in the same process, ``ar`` included; exactly T new tokens per
prompt (EOS ignored, so every method does the same work); speedup = tokens/s ÷ ``ar`` tokens/s
of the same run, dataset and setting.

Peers: ``hf_ar`` is transformers ``generate(do_sample=False)``; ``hf_assisted`` is assisted
generation with the draft (``assistant_model=``) at its defaults; ``hf_assisted_heuristic`` the
same with ``num_assistant_tokens_schedule="heuristic"``; ``hf_prompt_lookup`` is prompt lookup
decoding (``prompt_lookup_num_tokens=10``, n-grams up to 2 — transformers' own context-copying
drafter, the peer of ``lookup``).

Every (dataset, prompt, method, setting) becomes one Parquet row; ``report.py`` builds all
tables and plots from those rows alone.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .check import all_windowed, first_difference, prompt_budget, truncate_prompt
from .config import (METHODS, ARConfig, ar_reference, make_config, non_default_options, reference_label,
                     unused_options_notes)
from .engine import decode
from .machine import ensure_writable, versions
from .metrics import Metrics, counted, defined_mean, release_freed_memory, rss_bytes
from .models import ModelPair
from .policies import make_policy

HF_METHODS = ("hf_ar", "hf_assisted", "hf_assisted_heuristic", "hf_prompt_lookup")
HF_DRAFTED = ("hf_assisted", "hf_assisted_heuristic")  # (the peers that take the draft as assistant)
# The seed's named baselines: (method, options).  streaming_spec is StreamingLLM + speculative
# decoding as the DynaTree paper ran it (a K = 6 chain with a 1024-token cache).
PRESETS = {"streaming_spec": ("linear", {"k": 6, "kv_window": 1024})}
HUB_DATASETS = {
    "wikitext": ("wikitext", "wikitext-2-raw-v1", "test", "text"),
    "pg19": ("deepmind/pg19", None, "test", "text"),
}


@dataclass(frozen=True)
class MethodSpec:
    label: str
    method: str  # engine method or an hf_* peer
    options: dict = field(default_factory=dict)


def parse_methods(methods: str, options: list[str] | tuple = ()) -> list[MethodSpec]:
    """``"ar,linear,fixed=fixed_tree"`` + ``["fixed.depth=3", "temperature=0.6"]`` -> method specs.

    ``LABEL.KEY=VALUE`` sets one method's option; a bare ``KEY=VALUE`` sets it for every method
    that has it (sampling options reach the transformers peers too; a cache window's kv_sinks /
    kv_evict, the methods with a window), so one flag samples them all.  A :data:`PRESETS` name
    is its method with the preset's options (which options given override).
    """
    from .config import WINDOW_FIELDS

    specs = _method_labels(methods)
    shared, own = _split_options(options, specs)
    out, shaped = [], set()  # shaped: the window options given to every method that some window took
    for label, (meth, preset) in specs.items():
        opts = (_peer_options(label, shared, own) if meth in HF_METHODS else
                _method_options(label, meth, preset, shared, own.get(label, {}), shaped))
        out.append(MethodSpec(label, meth, opts))
    unused = [k for k in WINDOW_FIELDS[1:] if k in shared and k not in shaped]
    if unused:
        raise ValueError(f"--option {unused[0]}: no method in --methods has a cache window (kv_window) for it to shape")
    for ref in dict.fromkeys(reference_config(m) for m in out):
        if ref != ARConfig() and not any(m.method == "ar" and reference_config(m) == ref for m in out):
            out.append(MethodSpec(reference_label(ref), "ar", non_default_options(ref)))
    return out


def _method_labels(methods: str) -> dict[str, list]:
    """--methods -> {label: [method, preset options]}, ``ar`` first (speedups need the AR of the same run)."""
    specs: dict[str, list] = {}
    if not methods.strip(" ,"):
        raise ValueError("--methods is empty: name at least one method (e.g. --methods dynatree)")
    for item in (m.strip() for m in methods.split(",")):
        if item:
            label, eq, named = (p.strip() for p in item.partition("="))
            if not label or (eq and not named):
                raise ValueError(f"--methods {item!r}: give a method's name, or LABEL=METHOD with both parts")
            meth, preset = PRESETS.get(named or label, (named or label, {}))
            if label in specs:
                raise ValueError(f"--methods names {label!r} twice: give each method its own label (LABEL=METHOD)")
            if label == "ar" and meth != "ar":
                raise ValueError(f"--methods ar={meth}: the label ar names the ar every method is compared with")
            if named and named != label and label in (*METHODS, *HF_METHODS, *PRESETS):
                raise ValueError(f"--methods {item}: {label!r} is the name of another method; give this one "
                                 f"another label (its rows would read as {label}'s)")
            specs[label] = [meth, dict(preset)]
    return specs if "ar" in specs else {"ar": ["ar", {}], **specs}


def _split_options(options, specs: dict) -> tuple[dict, dict]:
    """--option values -> (every method's {key: value}, {label: that method's own})."""
    import dataclasses

    from .config import METHODS, parse_options

    shared, own = {}, {}
    for key, value in parse_options(options).items():
        label, dot, opt = key.partition(".")
        if not dot:
            shared[key] = value
        elif label not in specs:
            raise ValueError(f"--option {key}: {label!r} is not in --methods")
        elif label == "ar":  # (options given to every method reach it: the sampled methods' reference)
            raise ValueError(f"--option {key}: ar is the reference every method is compared with; give a "
                             f"configured ar a label of its own (e.g. --methods ar_2=ar --option ar_2.{opt}=...)")
        else:
            own.setdefault(label, {})[opt] = value
    for key in shared:
        if not any(key in {f.name for f in dataclasses.fields(METHODS[m])} for m, _ in specs.values()
                   if m in METHODS):
            raise ValueError(f"--option {key}: no method in --methods has this option")
    return shared, own


def _peer_options(label: str, shared: dict, own: dict) -> dict:
    """A transformers peer's options: the sampling ones given to every method (none of its own)."""
    import dataclasses

    from .config import SamplingConfig, WINDOW_FIELDS

    sampling_keys = {f.name for f in dataclasses.fields(SamplingConfig)}
    if own.get(label):
        raise ValueError(f"{label}: transformers peers take no options of their own")
    ar_keys = {f.name for f in dataclasses.fields(ARConfig)} - set(WINDOW_FIELDS[1:])  # (those reach windows only)
    other = [k for k in shared if k in ar_keys and k not in sampling_keys]  # they would run without it
    if other:
        raise ValueError(f"--option {other[0]} (given to every method) does not apply to transformers' "
                         f"peer {label}: give it to the methods by label (LABEL.{other[0]}=...) or "
                         "leave the peers out")
    given = {k: v for k, v in shared.items() if k in sampling_keys}
    cfg = make_config("ar", given)  # the same parsing and checks as the engine's methods
    return {k: getattr(cfg, k) for k in given}


def _method_options(label: str, meth: str, preset: dict, shared: dict, own: dict, shaped: set) -> dict:
    """An engine method's options: its preset's, those given to every method that it has, its own;
    a window's kv_sinks / kv_evict given to every method only where it has a window (added to ``shaped``)."""
    import dataclasses

    from .config import METHODS, SamplingConfig, WINDOW_FIELDS

    if meth not in METHODS:
        raise ValueError(f"unknown method {meth!r}; choose one of {', '.join(METHODS)}, the preset "
                         f"{', '.join(PRESETS)}, or (bench only) transformers' peers {', '.join(HF_METHODS)}")
    names = {f.name for f in dataclasses.fields(METHODS.get(meth, SamplingConfig))}
    given = {**preset, **{k: v for k, v in shared.items() if k in names}, **own}
    try:
        windowed = int(given.get("kv_window") or 0) > 0
    except (TypeError, ValueError):
        windowed = True  # (make_config says what is wrong with it)
    shape = WINDOW_FIELDS[1:]  # kv_sinks, kv_evict
    if windowed:
        shaped.update(k for k in shape if k in shared)
    else:
        given = {k: v for k, v in given.items() if k not in shape or k in preset or k in own}
    cfg = make_config(meth, given)
    return {k: getattr(cfg, k) for k in given}


def reference_config(ms: MethodSpec) -> ARConfig:
    """The ``ar`` a method's tokens must equal (config.ar_reference: ``ar`` with the method's
    sampling, cache window and dtype); transformers' peers are plain greedy ``ar``."""
    return ARConfig() if ms.method in HF_METHODS else ar_reference(make_config(ms.method, ms.options))


def reference(ms: MethodSpec, methods) -> MethodSpec | None:
    """The ``ar`` row a method's tokens are compared with: the one of its reference config."""
    return next((m for m in methods if m.method == "ar" and reference_config(m) == reference_config(ms)), None)


def with_references(chosen, methods) -> list[MethodSpec]:
    """``chosen`` plus the ``ar`` rows they are compared with (plain, and each window's), first."""
    refs = [m for m in methods if m.method == "ar" and m.label == "ar"] + [reference(m, methods) for m in chosen]
    return list({m.label: m for m in [r for r in refs if r is not None] + list(chosen)}.values())


SWEEP_DEFAULT = ("ar", "dynatree")


def load_bench_prompts(dataset: str, column: str = "text", n: int = 10, min_chars: int = 200) -> tuple[str, list[str]]:
    """(name, first n usable texts).  ``NAME=PATH`` labels a local file (a path that exists is read
    as one, "=" and all); ``wikitext``/``pg19``
    load the hub datasets (WikiText-2 raw test articles; PG-19 test books)."""
    from .data import read_texts

    name, sep, source = dataset.partition("=")
    if not sep or os.path.exists(dataset):  # (a path with "=" in it: hive partitions, lang=en/)
        name, source = Path(dataset).stem if os.path.exists(dataset) else dataset, dataset
    if source in HUB_DATASETS and not os.path.exists(source):
        hub, config, split, col = HUB_DATASETS[source]
        texts = read_texts(f"{hub}:{config}:{split}" if config else f"{hub}:{split}", col)
        if source == "wikitext":  # rows are lines; rebuild articles at top-level headings
            articles, cur = [], []
            for line in texts:
                if line.startswith(" = ") and not line.startswith(" = = ") and cur:
                    articles.append("".join(cur))
                    cur = []
                cur.append(line)
            texts = articles + ["".join(cur)]
    else:
        texts = read_texts(source, column)
    usable = [t for t in texts if isinstance(t, str) and len(t.strip()) >= min_chars]
    return name, usable[:n]


class PeakRSS:
    """Samples this process's resident memory in a thread; ``peak_mb`` above the start level.

    The kernel's own high-water mark only grows over a process's life, so it cannot tell two
    methods run in one process apart; sampling every few ms can, once freed memory has gone back
    to the OS (:func:`metrics.release_freed_memory`).  On CUDA use the allocator.
    """

    def __init__(self, device: torch.device, every_s: float = 0.002):
        self.device, self.every = device, every_s

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return self
        release_freed_memory()
        self.base = self.peak = rss_bytes()
        self._stop = threading.Event()

        def loop():
            while not self._stop.wait(self.every):
                self.peak = max(self.peak, rss_bytes())

        self._t = threading.Thread(target=loop, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            self._t.join()
            self.peak = max(self.peak, rss_bytes())

    @property
    def peak_mb(self) -> float:
        return (self.peak - self.base) / 2**20


@torch.inference_mode()
def run_hf(pair: ModelPair, method: str, prompt: list[int], max_new_tokens: int,
           sampling: dict | None = None) -> tuple[list[int], dict]:
    """transformers generate with or without the draft as assistant; EOS ignored.

    Greedy, unless ``sampling`` has temperature > 0 (then temperature/top_k/top_p/seed).
    """
    from transformers import GenerationConfig

    s = sampling or {}
    sample = s.get("temperature", 0) > 0
    extra = {"temperature": s["temperature"], "top_k": s.get("top_k", 0) or None,
             "top_p": s.get("top_p", 1.0)} if sample else {}
    if sample:
        torch.manual_seed(s.get("seed", 0))
    if method == "hf_prompt_lookup":
        extra["prompt_lookup_num_tokens"] = 10
    gc = GenerationConfig(do_sample=sample, max_new_tokens=max_new_tokens, min_new_tokens=0,
                          eos_token_id=None, pad_token_id=pair.eos_token_id or 0, **extra)
    kwargs = {}
    if method != "hf_ar" and method != "hf_prompt_lookup":
        kwargs["assistant_model"] = pair.draft
        # defaults: 20 tokens, "constant" schedule, confidence threshold 0.4
        pair.draft.generation_config.num_assistant_tokens = 20
        pair.draft.generation_config.num_assistant_tokens_schedule = (
            "heuristic" if method == "hf_assisted_heuristic" else "constant")
    ids = torch.tensor([prompt], device=pair.device)
    t0 = time.perf_counter()
    out = pair.target.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc, **kwargs)
    wall = time.perf_counter() - t0
    toks = out[0, len(prompt):].tolist()
    return toks, {"new_tokens": len(toks), "wall_time_s": wall,
                  "tokens_per_s": len(toks) / wall if wall else 0.0}


def bench_rows(pair: ModelPair, dataset: str, prompts: list[list[int]], methods: list[MethodSpec], *,
               warmup: int, max_new_tokens: int, max_prompt_tokens: int, setting: dict | None = None,
               first: int = 0, log=print) -> list[dict]:
    """Run every method on every prompt (prompt-major, so drift hits all methods alike).  Rows
    are compared with their reference ``ar`` (the same sampling and cache window; not transformers'
    sampled peers); ``speedup`` is against plain ``ar``, ``speedup_ref`` against the reference.
    ``prompts`` are the dataset's from number ``first`` on (rows' prompt_id: the dataset's numbers)."""
    rows: list[dict] = []
    setting = dict(setting or {})
    methods = with_references(methods, methods)  # each reference runs before the rows it checks
    refs = {ms.label: reference(ms, methods) for ms in methods}
    done = first  # prompts every method finished
    try:
        for i, prompt in enumerate(prompts):
            _prompt_rows(pair, dataset, first + i, i < warmup, prompt, methods, refs, max_new_tokens,
                         max_prompt_tokens, setting, rows)
            done = first + i + 1
            log(f"  {dataset} {json.dumps(setting) if setting else ''} prompt {i + 1}/{len(prompts)}"
                + ("  (warm-up)" if i < warmup else ""))
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM: what the finished prompts measured goes with it
        e.partial_rows = _speedups([r for r in rows if r["prompt_id"] < done])
        raise
    return _speedups(rows)


def _speedups(rows: list[dict]) -> list[dict]:
    """Each row's speedup against the AR of the same prompt, dataset and setting."""
    tps = {(r["prompt_id"], r["method"]): r["tokens_per_s"] for r in rows}
    for r in rows:
        for col, base in (("speedup", tps.get((r["prompt_id"], "ar"))),
                          ("speedup_ref", tps.get((r["prompt_id"], r["ref_method"])))):
            r[col] = r["tokens_per_s"] / base if base and r["tokens_per_s"] else None
    return rows


def _prompt_rows(pair, dataset, pi, warm, prompt, methods, refs, max_new_tokens, max_prompt_tokens, setting,
                 rows: list[dict]) -> None:
    """Every method on one prompt, a row each appended to ``rows``."""
    got = {}
    for ms in methods:
        pair.forget_prefixes()  # every method prefills the prompt itself
        with PeakRSS(pair.device) as mem:
            if ms.method in HF_METHODS:
                toks, m = run_hf(pair, ms.method, prompt, max_new_tokens, ms.options)
            else:
                toks, _, met = decode(pair, prompt, make_config(ms.method, ms.options),
                                      max_new_tokens=max_new_tokens, ignore_eos=True)
                m = met.as_dict()
        got[ms.label] = toks
        ref = refs[ms.label]
        # transformers' peers sample with torch's RNG: no ar reference draws their samples
        sampled = ms.method in HF_METHODS and ms.options.get("temperature", 0) > 0
        diff = first_difference(got[ref.label], toks) if ref is not None and not sampled else None
        rows.append({
            "dataset": dataset, "prompt_id": pi, "warmup": warm, "method": ms.label,
            "base_method": ms.method, "options": json.dumps(ms.options, sort_keys=True),
            "setting": json.dumps(setting, sort_keys=True), "max_new_tokens": max_new_tokens,
            "max_prompt_tokens": max_prompt_tokens, "token_ids": toks,  # (what "identical to ar" compared)
            **{f.name: m.get(f.name) for f in dataclasses.fields(Metrics)},  # one source: the dataclass
            "prompt_tokens": len(prompt), "peak_memory_mb": mem.peak_mb,
            "ref_method": ref.label if ref is not None else None,
            "matches_ar": None if sampled or ref is None or ref.label == ms.label else diff is None,
            "first_divergence": diff,
        })


@torch.inference_mode()
def run_hf_batch(pair: ModelPair, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers ``generate`` (greedy) on a left-padded batch; EOS ignored."""
    from transformers import GenerationConfig

    pad = pair.eos_token_id or 0
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)  # (B, W)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    gc = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=None,
                          pad_token_id=pad)
    out = pair.target.generate(ids.to(pair.device), attention_mask=mask.to(pair.device), generation_config=gc)
    return out[:, width:].tolist()


def batch_rows(pair: ModelPair, dataset: str, prompts: list[list[int]], methods: list[MethodSpec],
               batch_sizes: tuple[int, ...], *, max_new_tokens: int, max_prompt_tokens: int, log=print) -> list[dict]:
    """Throughput per actor at batch size B: every prompt decoded in batches of B (the engine's
    BatchDecoder; transformers' batched generate for hf_ar), tokens/s = all tokens ÷ all wall
    time, prefill included.  Each row's tokens are checked against batch-1 ``ar``."""
    refs: dict[ARConfig, list] = {}  # batch-1 ar's tokens per reference config (cache window, dtype)

    def ref_tokens(ms: MethodSpec) -> list:
        cfg = reference_config(ms)
        if cfg not in refs:
            refs[cfg] = []
            for p in prompts:
                pair.forget_prefixes()
                refs[cfg].append(decode(pair, p, cfg, max_new_tokens=max_new_tokens, ignore_eos=True)[0])
        return refs[cfg]

    greedy_only = [ms.label for ms in methods if ms.method == "hf_ar" and ms.options.get("temperature", 0) > 0]
    if greedy_only:  # (run_hf_batch is transformers' greedy generate: it would pass for a sample)
        log(f"  {', '.join(greedy_only)}: transformers' batched generate runs greedy only; left out of the sampled "
            "batch sweep")
    one_at_a_time = [ms.label for ms in methods if ms.method in HF_METHODS and ms.method != "hf_ar"]
    if one_at_a_time:  # (transformers' assisted generation and prompt lookup decode one sequence at a time)
        log(f"  {', '.join(one_at_a_time)}: transformers runs it one sequence at a time, outside dynatree's batched "
            "engine, so it gives no numbers in a batch sweep (B = 1 included); measure it in a bench without "
            "--batch-sizes (the one-at-a-time table)")
    methods = [ms for ms in methods if ms.label not in one_at_a_time and ms.label not in greedy_only]
    over = [b for b in batch_sizes if b > len(prompts)]
    if over:  # (a batch of the prompts there are, not B of them: labelled as what ran)
        log(f"  B = {', '.join(map(str, over))}: only {counted(len(prompts), 'prompt')} "
            f"{'is' if len(prompts) == 1 else 'are'} measured, so the largest batch is {len(prompts)} (give --prompts "
            "of at least B plus the warm-up)")
    rows: list[dict] = []
    try:
        for b in dict.fromkeys(min(b, len(prompts)) for b in batch_sizes):
            rows += _size_rows(pair, dataset, prompts, methods, b, ref_tokens, max_new_tokens, max_prompt_tokens,
                               [x for x in over if b == len(prompts)], log)
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM: the sizes measured go with it (they had been lost)
        e.partial_rows = rows
        raise
    return rows


def _size_rows(pair: ModelPair, dataset: str, prompts: list, methods: list[MethodSpec], b: int, ref_tokens,
               max_new_tokens: int, max_prompt_tokens: int, asked: list[int], log) -> list[dict]:
    """batch_rows at one batch size ``b``: each method warmed up, then measured in turns."""
    from .engine import decode_batch

    def run(ms, chunk, n):
        pair.forget_prefixes()  # each batch starts with what a fresh job has: prompts it shares it shares
        if ms.method == "hf_ar":
            return [(t, None) for t in run_hf_batch(pair, chunk, n)]
        return [(t, m) for t, _, m in decode_batch(pair, chunk, make_config(ms.method, ms.options),
                                                    max_new_tokens=n, ignore_eos=True)]

    for ms in methods:
        run(ms, prompts[:b], 4)  # warm-up (first-use costs, budget profile)
    # Methods take turns on each batch of prompts, in a rotating order, so the host's drift
    # (±20% over minutes here) falls on every method alike instead of on whichever ran last.
    got, wall, k = [[] for _ in methods], [0.0] * len(methods), len(methods)
    for i, at in enumerate(range(0, len(prompts), b)):
        for j in [(i + j) % k for j in range(k)]:
            t0 = time.perf_counter()
            got[j] += run(methods[j], prompts[at:at + b], max_new_tokens)
            wall[j] += time.perf_counter() - t0
    rows = []
    for j, ms in enumerate(methods):
        ref = reference(ms, methods)  # (None: a peer's, plain ar, which may not be among the methods)
        rows.append(_batch_row(dataset, ms, b, prompts, got[j], wall[j], ref_tokens(ms), ref.label if ref else "ar",
                               max_new_tokens, max_prompt_tokens, asked=asked))
        log(f"  {dataset} B={b} {ms.label}: {rows[-1]['tokens_per_s']:.1f} tokens/s, "
            f"{rows[-1]['rows_matching_ar']}/{len(prompts)} rows == ar")
    return rows


def _batch_row(dataset: str, ms: MethodSpec, b: int, prompts: list, got: list, wall: float, ref: list,
               ref_label: str, max_new_tokens: int, max_prompt_tokens: int, asked: list = ()) -> dict:
    """One (dataset, method, B) row of the batch sweep; got: (tokens, metrics or None) per prompt;
    ref: batch-1 tokens of its reference ``ar`` (labelled ref_label) per prompt; asked: the batch
    sizes asked for that this B, all the prompts, stands for (kept in the setting: the report says so)."""
    mets = [m for _, m in got if m is not None]
    same = sum(t == r for (t, _), r in zip(got, ref))
    new_tokens = sum(len(t) for t, _ in got)
    return {
        "dataset": dataset, "prompt_id": -1, "warmup": False, "method": ms.label, "base_method": ms.method,
        "options": json.dumps(ms.options, sort_keys=True),
        "setting": json.dumps({"sweep": "batch", "B": b, **({"asked": list(asked)} if asked else {})}, sort_keys=True),
        "max_new_tokens": max_new_tokens,
        "max_prompt_tokens": max_prompt_tokens, "prompt_tokens": sum(map(len, prompts)),  # (all the rows')
        "ref_method": ref_label,
        "new_tokens": new_tokens, "tokens_per_s": new_tokens / wall, "wall_time_s": wall,
        "tokens_per_iteration": defined_mean(m.tokens_per_iteration for m in mets),
        "mean_tree_size": defined_mean(m.mean_tree_size for m in mets), "matches_ar": same == len(prompts),
        "rows_matching_ar": same, "rows": len(prompts),
    }


@dataclass(frozen=True)
class BenchSpec:
    datasets: tuple[str, ...]
    methods: tuple[MethodSpec, ...]
    prompts: int = 10
    warmup: int = 2
    max_prompt_tokens: int = 200
    max_new_tokens: int = 128
    prompt_column: str = "text"
    sweep_tokens: tuple[int, ...] = ()  # T values (methods as given)
    sweep_prompt_len: tuple[int, ...] = ()  # L_max values
    grid: dict = field(default_factory=dict)  # fixed-tree grid: {"depth": [...], "branch": [...], "tau": [...]}
    sweep_methods: tuple[str, ...] = SWEEP_DEFAULT  # methods run in the T / L sweeps (labels; the default's absent ones are left out)
    batch_sizes: tuple[int, ...] = ()  # B values: throughput per actor with the batched engine

    def __post_init__(self):
        for ms in grid_methods(self.grid):  # a bad grid value fails here, not after the main table has run
            make_config(ms.method, ms.options)

    @property
    def hf_peers(self) -> bool:
        """Whether transformers' peers run: they call transformers' generate, so the pair needs
        transformers' model classes (models.load_pair(transformers_models=True))."""
        return any(m.method in HF_METHODS for m in self.methods)


def grid_methods(grid: dict, shared: dict | None = None) -> list[MethodSpec]:
    """The fixed-tree grid's methods, each with its own options and ``shared``: the options given to
    every method that ``ar`` takes too (sampling, cache window), so the grid's ``ar`` is the run's."""
    import itertools

    keys = [k for k in ("depth", "branch", "tau") if grid.get(k)]
    out = []
    for combo in itertools.product(*(grid[k] for k in keys)):
        opts = dict(zip(keys, combo))
        label = "fixed_tree[" + ",".join(f"{k}={v}" for k, v in opts.items()) + "]"
        out.append(MethodSpec(label, "fixed_tree", {**(shared or {}), **opts}))
    return out


def prepare(spec: BenchSpec, out_dir: str | Path, log=print) -> list[tuple[str, str, list[str]]]:
    """What a bench checks before any model loads (cli.bench calls it first: a typo in a dataset's
    path, --out or --sweep-methods had waited for the models, minutes with large ones): every
    dataset's prompts (returned, for run_bench), their names, the sweep labels, and that --out
    takes the results (a directory this made is removed again)."""
    loaded = [(ds, *load_bench_prompts(ds, spec.prompt_column, spec.prompts)) for ds in spec.datasets]
    names = [name for _, name, _ in loaded]
    if len(set(names)) < len(names):
        raise ValueError(f"two datasets named {next(n for n in names if names.count(n) > 1)!r}: their rows "
                         "would merge; label them NAME=PATH")
    if (spec.sweep_tokens or spec.sweep_prompt_len) and spec.sweep_methods not in (("all",), SWEEP_DEFAULT):
        unknown = [m for m in spec.sweep_methods if m not in {m.label for m in spec.methods}]
        if unknown:
            raise ValueError(f"--sweep-methods {','.join(unknown)}: not among the methods "
                             f"({', '.join(m.label for m in spec.methods)}; or 'all')")
    for ds, name, texts in loaded:
        if len(texts) <= spec.warmup:
            had = (f"--prompts {spec.prompts} leaves" if len(texts) == spec.prompts else
                   f"{counted(len(texts), 'usable prompt')} (texts of at least 200 characters) leave")
            raise ValueError(f"dataset {ds}: {had} none to measure after --warmup {spec.warmup}")
    out = Path(out_dir)
    missing = [p for p in (out, *out.parents) if not p.exists()]  # (the leaf first)
    try:
        _writable(out)
    finally:  # (made or not, probed or not: nothing left behind)
        for p in missing:
            with contextlib.suppress(OSError):
                p.rmdir()
    return loaded


def _writable(out: Path) -> None:
    try:  # an unwritable or full --out fails before hours of measuring; results and plots take < 1 MB
        ensure_writable(out, room=1 << 20)
    except OSError as e:
        raise ValueError(f"--out {out} cannot take the results: {e.strerror or e}") from None


def run_bench(pair: ModelPair, spec: BenchSpec, out_dir: str | Path, log=print, loaded: list | None = None) -> Path:
    """Measure ``spec`` on ``pair`` and write the results to ``out_dir``; ``loaded``: prepare()'s
    prompts where the caller checked the inputs before loading the pair."""
    if spec.hf_peers and not hasattr(pair.target, "generate"):
        raise ValueError("transformers' peers (hf_*) call transformers' generate: load the pair with "
                         "load_pair(..., transformers_models=True) or kernel='hf'")
    spec = _decodable(pair, spec, log)
    loaded = prepare(spec, out_dir, log) if loaded is None else loaded
    out = Path(out_dir)
    made = not out.exists()
    _writable(out)
    if (out / "results.parquet").exists():
        log(f"note: {out} holds an earlier bench's results.parquet: this bench's replace it once it ends (another "
            "--out keeps them)")
    rows: list[dict] = []
    t0 = time.time()
    host = _machine(pair)  # the CPU, and its FMA rate before the first prompt
    try:
        kept = _measure(pair, spec, rows, log, loaded)
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):  # Ctrl-C, SIGTERM: keep what was measured (a bench can take hours)
            rows += getattr(e, "partial_rows", [])
            measured = any(not r["warmup"] for r in rows)  # (warm-up rows alone had replaced an earlier bench's)
            if measured:  # (with nothing measured, an earlier bench's results stay)
                _write(out, pair, spec, rows, t0, None, interrupted=True, log=log, kept=getattr(e, "kept", None),
                       host=host)
            e.saved = measured
        if made and not any(out.iterdir()):  # (a bad input found before any row: no empty directory left)
            out.rmdir()
        raise
    return _write(out, pair, spec, rows, t0, loaded, log=log, kept=kept, host=host)


def _machine(pair: ModelPair) -> dict:
    """bench.json's "machine": the CPU and, on a CPU run, the native kernel's FMA probe on the run's
    threads and on one (machine.fma_rates; measured again at the end: a drift of the host, or
    threads sharing a core, shows beside the numbers it moved)."""
    from .machine import cpu, fma_rates

    host = {"cpu": cpu()}
    if pair.device.type == "cpu":
        host["fma_start"] = fma_rates(torch.get_num_threads())
    return host


def _decodable(pair: ModelPair, spec: BenchSpec, log) -> BenchSpec:
    """``spec`` without the methods this pair cannot decode (a draft that grows no trees) and
    without a fixed-tree --grid then, each named, as `dynatree check` does (ModelPair.decodable:
    a ValueError when no method is left; transformers' peers, which decode on their own, stay)."""
    cfgs = {m.label: ARConfig() if m.method in HF_METHODS else make_config(m.method, m.options) for m in spec.methods}
    pair.need_draft([m.label for m in spec.methods if m.method in HF_DRAFTED or make_policy(cfgs[m.label]).needs_draft])
    ok = pair.decodable(cfgs, log)
    short = [m.label for m in spec.methods if m.method in HF_DRAFTED and pair.draft_positions]
    if short:  # (transformers feeds its assistant the whole text: past a learned table, an IndexError)
        log(f"note: skipping {', '.join(short)}: transformers' assisted generation runs the draft over the whole "
            f"text, and the draft's {pair.draft_positions} positions are fewer than the target's {pair.max_context} "
            "(dynatree's methods restart it within them)")
        ok = {label: cfg for label, cfg in ok.items() if label not in short}
    for note in unused_options_notes({m.label: cfgs[m.label] for m in spec.methods if m.method not in HF_METHODS}):
        log(f"note: {note}")
    grid, problem = spec.grid, spec.grid and pair.method_problem(make_config("fixed_tree"))
    if problem:
        log(f"note: skipping the --grid (fixed trees): {problem}")
        grid = {}
    methods = tuple(m for m in spec.methods if m.label in ok)
    return spec if (methods, grid) == (spec.methods, spec.grid) else dataclasses.replace(spec, methods=methods, grid=grid)


def _write(out: Path, pair: ModelPair, spec: BenchSpec, rows: list[dict], t0: float, loaded, interrupted: bool = False,
           log=print, kept: int | None = None, host: dict | None = None) -> Path:
    """results.parquet (every row's columns: a sweep's rows have more than a batch's) and bench.json;
    an earlier bench's files in ``out`` go (its plots would sit beside the new tables)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if (out / "results.parquet").exists():
        log(f"replacing the earlier bench results in {out}")
    from .report import old_plots

    for old in [out / "results.parquet", out / "bench.json", out / "summary.md", *old_plots(out)]:
        old.unlink(missing_ok=True)
    if host and "fma_start" in host:  # (the probe again: what the host ran at when the bench ended)
        from .machine import fma_rates

        host["fma_end"] = fma_rates(torch.get_num_threads())
    names = list(dict.fromkeys(k for r in rows for k in r))
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in names} for r in rows]), out / "results.parquet")
    meta = {"spec": {**asdict(spec), "methods": [asdict(m) for m in spec.methods]},
            "pair": pair.names, "device": str(pair.device), "dtype": str(pair.dtype).replace("torch.", ""), "kernel": pair.kernel,
            "forward": {w: pair.forward_in_use(w) for w in ("target", "draft") if pair.runner(w) is not None},
            "max_prompt_tokens_kept": kept,
            "threads": torch.get_num_threads(), "wall_time_s": time.time() - t0,
            "prompts_used": {name: len(texts) for _, name, texts in loaded} if loaded else None,
            "interrupted": interrupted, "machine": host, "versions": versions()}
    (out / "bench.json").write_text(json.dumps(meta, indent=2, default=str))
    return out


def _measure(pair: ModelPair, spec: BenchSpec, rows: list[dict], log, loaded: list) -> int:
    """Every measurement of the bench on ``loaded`` (prepare()'s prompts), appended to ``rows`` as it
    is made; returns the prompt tokens the main setting kept."""
    if not (spec.sweep_tokens or spec.sweep_prompt_len) and spec.sweep_methods != SWEEP_DEFAULT:
        log("note: --sweep-methods chooses the methods of --sweep-tokens / --sweep-prompt-len, and neither is given")
    if ((spec.sweep_tokens or spec.sweep_prompt_len) and spec.sweep_methods == SWEEP_DEFAULT
            and not any(m.label == "dynatree" for m in spec.methods)):
        log("note: the sweeps run ar and dynatree by default, and --methods has no dynatree: they run ar "
            "alone (choose others with --sweep-methods)")
    for ds, name, texts in loaded:
        if len(texts) < spec.prompts:  # (said, not measured quietly on fewer)
            log(f"note: dataset {ds} has {counted(len(texts), 'usable prompt')} (texts of at least 200 characters), "
                f"fewer than --prompts {spec.prompts}: measuring {len(texts) - spec.warmup}")
    cfgs = {m.label: None if m.method in HF_METHODS else make_config(m.method, m.options) for m in spec.methods}
    # a window the context cannot hold fails here, not after the methods before it ran
    pair.check_methods({label: c for label, c in cfgs.items() if c is not None})
    keep = _prompt_budgets(pair, spec, all_windowed(cfgs.values()))  # (a T that fills the context fails here)
    lmax = keep[spec.max_prompt_tokens, spec.max_new_tokens]
    try:
        _measure_all(pair, spec, rows, log, loaded, keep, lmax)
    except KeyboardInterrupt as e:
        e.kept = lmax  # (an interrupted bench's summary names the prompt length it measured)
        raise
    return lmax


def _measure_all(pair: ModelPair, spec: BenchSpec, rows: list[dict], log, loaded, keep: dict, lmax: int) -> None:
    """Every setting of every dataset, appended to ``rows`` as measured (``keep``: _prompt_budgets)."""
    for ds, name, texts in loaded:
        enc = [pair.encode(t) for t in texts]
        lead = len(pair.leading_ids)  # (a BOS the tokenizer adds stays first when a prompt is cut)
        full = [truncate_prompt(e, lmax, lead=lead) for e in enc]
        cut = f" (cut from {spec.max_prompt_tokens}: the {pair.max_context}-token context holds the new tokens too)"
        log(f"{name}: {counted(len(full), 'prompt')} ({spec.warmup} warm-up), L_max={lmax}"
            f"{cut if lmax < spec.max_prompt_tokens else ''}, T={spec.max_new_tokens}")
        if not spec.batch_sizes:  # with batch sizes, B = 1 is the one-at-a-time measurement
            rows += bench_rows(pair, name, full, list(spec.methods), warmup=spec.warmup,
                               max_new_tokens=spec.max_new_tokens, max_prompt_tokens=lmax,
                               setting={"sweep": "main"}, log=log)
        sweep_ms = with_references([m for m in spec.methods if m.label in spec.sweep_methods
                                    or spec.sweep_methods == ("all",)], spec.methods)
        # the main setting has warmed every method up: the sweeps measure every prompt they run
        skip, warm = (spec.warmup, 0) if not spec.batch_sizes else (0, spec.warmup)
        for t in spec.sweep_tokens:
            lt = keep[spec.max_prompt_tokens, t]
            if lt < spec.max_prompt_tokens:
                log(f"{name}: sweep T={t}: prompts cut to {lt} tokens (the context holds the new tokens too)")
            rows += bench_rows(pair, name, [truncate_prompt(e, lt, lead=lead) for e in enc[skip:]], sweep_ms, warmup=warm,
                               max_new_tokens=t, max_prompt_tokens=lt, setting={"sweep": "tokens", "T": t}, first=skip, log=log)
        seen: dict = {}  # the prompts each L cut, by their lengths
        for lp in sorted(spec.sweep_prompt_len):  # (a value past every prompt repeats the one below it)
            ll = keep[lp, spec.max_new_tokens]
            cut = [truncate_prompt(e, ll, lead=lead) for e in enc[skip:]]
            same = seen.setdefault(tuple(map(len, cut)), lp)
            if same != lp:  # (L = 400 and 800 over prompts of ~330 tokens read as two points: the bench trial)
                log(f"{name}: sweep L={lp} left out: its prompts are at most {max(map(len, cut))} tokens, so it would "
                    f"measure the same prompts as L={same}")
                continue
            rows += bench_rows(pair, name, cut, sweep_ms, warmup=warm, max_new_tokens=spec.max_new_tokens,
                               max_prompt_tokens=ll, setting={"sweep": "prompt_len", "L": lp}, first=skip, log=log)
        if spec.batch_sizes:  # (the batch sweep warms each (B, method) up itself)
            rows += batch_rows(pair, name, full[spec.warmup:], list(spec.methods), spec.batch_sizes,
                               max_new_tokens=spec.max_new_tokens, max_prompt_tokens=lmax, log=log)
        if spec.grid:
            ar = next(m for m in spec.methods if m.label == "ar")  # (with the options given to every method)
            rows += bench_rows(pair, name, full, [ar] + grid_methods(spec.grid, ar.options),
                               warmup=spec.warmup, max_new_tokens=spec.max_new_tokens,
                               max_prompt_tokens=lmax, setting={"sweep": "grid"}, log=log)


def _prompt_budgets(pair: ModelPair, spec: BenchSpec, windowed: bool) -> dict[tuple[int, int], int]:
    """(L_max, T) -> the prompt tokens kept for every setting the bench measures (check.prompt_budget:
    fewer where the context must hold the T new tokens, unless every method is ``windowed``)."""
    settings = {(spec.max_prompt_tokens, t) for t in (spec.max_new_tokens, *spec.sweep_tokens)}
    settings |= {(lp, spec.max_new_tokens) for lp in spec.sweep_prompt_len}
    keep = {(lp, t): prompt_budget(pair.max_context, windowed, lp, t) for lp, t in settings}
    over = [lp for lp in spec.sweep_prompt_len if keep[lp, spec.max_new_tokens] < lp]
    if over:  # (cut, two values would measure the same prompts as different points)
        raise ValueError(f"--sweep-prompt-len {','.join(map(str, over))}: the {pair.max_context}-token context "
                         f"holds {keep[over[0], spec.max_new_tokens]} prompt tokens beside T={spec.max_new_tokens}; "
                         "sweep lengths up to that")
    return keep
