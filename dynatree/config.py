"""Algorithm configurations (frozen dataclasses) and ``key=value`` option parsing.

Every method's options are the fields of one dataclass; ``help`` metadata on each field feeds
``dynatree generate --help`` (:func:`options_help`), so defaults are documented in one place
(the README's table of options is written by hand from it).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
from dataclasses import dataclass, field

# (here, not in models.py, so that the job driver, which imports no torch, says the same)
SLOW_ON_CPU = {  # a model's dtype -> why it is slow on a CPU (a warning where it is asked for or found)
    "float16": "dtype float16 on a CPU runs torch's slow float16 kernels, never the native kernel (6-11x slower "
               "than float32 on this project's 2-core Intel host, ~18x on its AMD EPYC): use float32 on CPUs",
    "bfloat16": "dtype bfloat16 on a CPU runs torch's bfloat16 ops, never the native kernel (6-9x slower than "
                "float32 on this project's 2-core Intel host; transformers loads a checkpoint in the dtype it "
                "was saved in unless given dtype=torch.float32): use float32 on CPUs, or the kernel lean-bf16 for "
                "bfloat16 products on float32 weights",
}


KV_DTYPES = ("model", "bfloat16")  # MethodConfig.kv_dtype: the model's dtype, or a torch dtype's name
DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")  # a model's dtypes, as jobs and summaries name them
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}


def is_device_name(name) -> bool:
    """Whether ``name`` names a device dynatree runs on: auto, cpu, cuda or cuda:N (the job spec,
    the commands' --device and resolve_device check it alike)."""
    return isinstance(name, str) and re.fullmatch(r"auto|cpu|cuda(:\d+)?", name) is not None


def dtype_name(name):
    """A dtype's name as everything compares it (``fp16`` is ``float16``); anything else as given."""
    return DTYPE_ALIASES.get(name, name) if isinstance(name, str) else name


def opt(default, help: str):
    return field(default=default, metadata={"help": help})


MIN_TEMPERATURE = 1e-6  # the smallest sampling temperature: below, scores / temperature overflow float32


@dataclass(frozen=True)
class SamplingConfig:
    """Options shared by every method: temperature 0 is greedy, anything above samples."""

    temperature: float = opt(0.0, "sampling temperature; 0 = greedy.  Every method's tokens are ar's: greedy, "
                                  "or sampled with the same seed")
    top_k: int = opt(0, "sample only among the k most likely tokens (0 = all)")
    top_p: float = opt(1.0, "nucleus sampling: the smallest set of tokens with this much probability")
    seed: int = opt(0, "random seed; the same seed reproduces a sampled generation, whatever the method, "
                       "budget or batch (several prompts or samples: each draw's own seed is derived from it)")

    @property
    def sampling_key(self) -> tuple:
        """What a draft's acceptance statistics depend on besides the pair (budget.Calibration,
        lookup.LookupStats are kept per key): greedy, or the sampling settings."""
        return ("greedy",) if self.temperature == 0 else ("sampled", self.temperature, self.top_k, self.top_p)

    def __post_init__(self):
        _check_types(self)
        if not 0 <= self.temperature < math.inf:  # NaN too
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:  # logits / temperature would overflow float32
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {self.temperature:g}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 <= self.seed < 1 << 64:  # the noise keys are 64-bit (sampling._mix): larger ones would wrap
            raise ValueError(f"seed must be a whole number in [0, 2**64), got {self.seed}")


@dataclass(frozen=True)
class MethodConfig(SamplingConfig):
    """Options every method has: sampling (above) and the KV cache policy (StreamingLLM's window)."""

    kv_window: int = opt(0, "StreamingLLM cache: keep at most this many tokens in each model's KV cache — "
                            "kv_sinks first tokens plus the most recent ones, positions counted in the "
                            "cache, so memory and attention stay bounded however long the generation "
                            "(0 = off: the whole text is cached)")
    kv_sinks: int = opt(4, "with kv_window: the first tokens kept for good (StreamingLLM's attention sinks)")
    kv_evict: int = opt(64, "with kv_window: tokens dropped at once when the cache is full (the cache holds "
                            "kv_window - kv_evict .. kv_window tokens; trees fit in what is left; a prompt "
                            "past the window is prefilled kv_evict tokens a forward)")
    kv_dtype: str = opt("model", "KV cache storage: 'model' (the model's dtype) or 'bfloat16' (half the bytes "
                                 "a forward streams from the caches; keys and values rounded once as they are "
                                 "cached, so every greedy method equals ar with the same kv_dtype; the native "
                                 "CPU kernel reads it as is, torch paths widen the whole cache every forward, "
                                 "which costs more than it saves)")
    prefix_cache: bool = opt(True, "share keys/values with other prompts that begin the same way (a template, "
                                   "few-shot examples): the common beginning is computed once and copied, in "
                                   "blocks of 32 tokens; the same tokens on the native kernel (prefix.py)")

    @property
    def node_budget(self) -> int:
        """The most drafted nodes a tree may hold (the room a row's caches keep beyond its text)."""
        return 0

    @property
    def lookup_length(self) -> int:
        """Tokens of context lookup grafted onto a tree (0: off)."""
        return 0

    def __post_init__(self):
        super().__post_init__()
        if self.kv_window < 0:
            raise ValueError("kv_window must be >= 0 (0 = off)")
        object.__setattr__(self, "kv_dtype", dtype_name(self.kv_dtype))  # (bf16: bfloat16, as --dtype takes it)
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, not {self.kv_dtype!r}")
        if self.kv_window and (self.kv_sinks < 0 or self.kv_evict < 1):
            raise ValueError(f"a cache window needs kv_sinks >= 0 and kv_evict >= 1, got kv_sinks={self.kv_sinks}, "
                             f"kv_evict={self.kv_evict}")
        if self.kv_window and self.kv_window <= self.kv_sinks + self.kv_evict:
            raise ValueError(f"kv_window={self.kv_window} must exceed kv_sinks + kv_evict "
                             f"({self.kv_sinks} + {self.kv_evict})")
        method = next((k for k, v in METHODS.items() if v is type(self)), type(self).__name__)
        for name in _AT_LEAST_ONE:
            if not 1 <= getattr(self, name, 1) <= MAX_COUNT:
                raise ValueError(f"{method} option {name} must be within [1, {MAX_COUNT}], got {getattr(self, name)}")
        for name in ("tau", "threshold"):
            if not 0 <= getattr(self, name, 0) <= 1:
                raise ValueError(f"{method} option {name} must be within [0, 1], got {getattr(self, name)}")
        if self.node_budget > MAX_TREE_NODES:  # (MemoryError, or the native kernel's abort: trials AE, AG)
            name = next(n for n in ("max_nodes", "budget", "k") if getattr(self, n, None) == self.node_budget)
            raise ValueError(f"{method} option {name} must be at most {MAX_TREE_NODES}, got {self.node_budget}: a "
                             "tree's verification grows with the square of its nodes (a tree of 100,000 needed 40 GB "
                             "of scratch), and trees pay at tens to hundreds of nodes")


@dataclass(frozen=True)
class ARConfig(MethodConfig):
    """Autoregressive decoding with the target only (one token per target forward)."""


@dataclass(frozen=True)
class SpecConfig(MethodConfig):
    """Options shared by every speculative method."""

    kv_update: str = opt("gather", "target cache after acceptance: 'gather' keeps the accepted nodes' "
                                   "keys/values (one target forward per iteration); 'recompute' crops and "
                                   "re-runs the accepted tokens (the seed's second forward)")
    lookup: int = opt(0, "context lookup: graft up to this many tokens copied from the text so far (what "
                         "followed the latest earlier occurrence of the longest repeated suffix, up to 8 tokens) onto each tree; "
                         "0 = off")
    draft_context: int = opt(128, "the most committed tokens the draft reads when it (re)starts: a "
                                  "prompt's last draft_context tokens, and a draft that fell further behind (rows "
                                  "drafting nothing while the hardware budget keeps trees off) restarts on the last "
                                  "draft_context tokens instead of catching up on all of them.  Changes proposals, "
                                  "never the output (0 = the whole text)")

    @property
    def lookup_length(self) -> int:
        return self.lookup

    def __post_init__(self):
        super().__post_init__()
        if self.draft_context < 0:
            raise ValueError(f"draft_context must be >= 0 (0 = the whole text), got {self.draft_context}")
        if self.lookup < (-1 if isinstance(self, DynaTreeConfig) else 0):
            raise ValueError("lookup must be >= 0" + (" (or -1: automatic)" if isinstance(self, DynaTreeConfig) else ""))
        if self.kv_update not in ("gather", "recompute"):
            raise ValueError("kv_update must be 'gather' or 'recompute'")


@dataclass(frozen=True)
class LinearConfig(SpecConfig):
    """Draft a chain of k tokens, verify them in one pass."""

    k: int = opt(5, "draft tokens per iteration")

    @property
    def node_budget(self) -> int:
        return self.k


@dataclass(frozen=True)
class FixedTreeConfig(SpecConfig):
    """The seed's fixed tree ("V2"): top-B children per node to depth D, pruning and node budget."""

    depth: int = opt(5, "tree depth D (drafted tokens on the longest path)")
    branch: int = opt(2, "children per expanded node B")
    tau: float = opt(0.02, "prune nodes whose cumulative draft probability is below tau")
    max_nodes: int = opt(256, "node budget N_max (drafted nodes, root excluded)")

    @property
    def node_budget(self) -> int:
        return self.max_nodes


@dataclass(frozen=True)
class DynaTreeConfig(SpecConfig):
    """DynaTree: confidence-aware breadth, dynamic depth, pruning, node budget, history adaptation."""

    d0: int = opt(5, "base depth D_0")
    d_max: int = opt(8, "hard maximum depth D_max")
    b_min: int = opt(1, "children when draft confidence >= tau_h")
    b_mid: int = opt(2, "children when tau_l <= confidence < tau_h (and the branching when breadth is fixed)")
    b_max: int = opt(3, "children when confidence < tau_l")
    tau_h: float = opt(0.9, "high-confidence threshold on the draft's top-1 probability")
    tau_l: float = opt(0.4, "low-confidence threshold on the draft's top-1 probability")
    rho_stop: float = opt(0.05, "stop expanding a node whose path probability is below rho_stop")
    rho_deep: float = opt(0.3, "expand beyond D_0 only where the path probability is >= rho_deep")
    tau: float = opt(0.02, "prune nodes whose path probability is below tau")
    max_nodes: int = opt(256, "node budget N_max (drafted nodes, root excluded)")
    window: int = opt(10, "history window W (iterations)")
    hist_high: float = opt(0.7, "windowed acceptance at or above which drafting gets more aggressive")
    hist_low: float = opt(0.3, "windowed acceptance at or below which drafting gets more conservative")
    dynamic_breadth: bool = opt(True, "per-node branching from draft confidence (off: b_mid everywhere)")
    dynamic_depth: bool = opt(True, "rho_stop / rho_deep depth gating up to d_max (off: fixed depth d0)")
    history: bool = opt(True, "adapt d0 and tau_h from the acceptance of the last W iterations")
    lookup: int = opt(-1, "context lookup (tokens copied from what followed an earlier occurrence of the text's "
                          "latest tokens): up to this many, grafted while "
                          "their learned acceptance pays for their verification under the hardware budget "
                          "(all of them with hw_budget=off); -1 (default) = 8 when the hardware budget is "
                          "on and decoding is greedy, off when sampling (copies are rarely the draw) or "
                          "without the budget (the paper's drafting)")
    hw_budget: str = opt("auto", "'auto' (default): hardware-aware budget — draft and verify only the nodes "
                             "whose expected tokens pay for their measured time on this device (see "
                             "budget.py); 'off': the paper's node budget alone (the paper's ablation).  "
                             "Either way the tokens are ar's, greedy or sampled with the same seed")

    @property
    def budget_on(self) -> bool:
        return self.hw_budget == "auto"

    @property
    def node_budget(self) -> int:
        return self.max_nodes

    @property
    def lookup_length(self) -> int:
        """The lookup length in effect: ``lookup``, or for -1 8 under the budget when greedy, else 0
        (unbudgeted, a copy is grafted whole however rarely it is right; sampled, copies are rarely
        the draw: with the budget pricing them, keeping the index and grafting still cost more than
        they won -- lookup=0 decoded 3-8% faster at T = 0.6-1.0 on both bench files, 2026-11-29)."""
        # 8, not 12: the budget's price of a long copied chain is optimistic; capping it at 8 ran
        # 3-8% faster at T >= 500 in five paired runs on both bench files, no slower at T = 128
        return self.lookup if self.lookup >= 0 else (8 if self.budget_on and not self.temperature else 0)

    def __post_init__(self):
        super().__post_init__()
        if not (1 <= self.d0 < self.d_max):
            raise ValueError(f"need 1 <= d0 < d_max, got d0={self.d0}, d_max={self.d_max}")
        if not (1 <= self.b_min <= self.b_mid <= self.b_max):
            raise ValueError("need 1 <= b_min <= b_mid <= b_max")
        if not (0 < self.tau_l < self.tau_h < 1):
            raise ValueError("need 0 < tau_l < tau_h < 1")
        if not (0 < self.rho_stop < self.rho_deep < 1):
            raise ValueError("need 0 < rho_stop < rho_deep < 1")
        if not 0 <= self.hist_low < self.hist_high <= 1:
            raise ValueError(f"need 0 <= hist_low < hist_high <= 1, got hist_low={self.hist_low}, "
                             f"hist_high={self.hist_high}")
        said = self.hw_budget.strip().lower()  # (YAML's `on`, a True; the spellings a switch option takes)
        said = "auto" if said in ("on", "true", "yes", "1") else "off" if said in ("false", "no", "0") else said
        object.__setattr__(self, "hw_budget", said)
        if self.hw_budget not in ("auto", "off"):
            raise ValueError(f"hw_budget must be 'auto' (or on, true) or 'off' (or false), got {self.hw_budget!r}")


@dataclass(frozen=True)
class DySpecConfig(SpecConfig):
    """DySpec: grow the tree by estimated acceptance value (heap), or layer by layer over a threshold."""

    mode: str = opt("threshold", "'threshold': expand layer by layer every candidate whose value >= "
                                 "`threshold` (one draft call per layer; what DySpec ran in its experiments); "
                                 "'heap': greedy best-first up to `budget` nodes (about one draft call per node)")
    budget: int = opt(32, "node budget m for the heap mode (and a cap on nodes for the threshold mode)")
    threshold: float = opt(0.03, "value threshold for the threshold mode (DySpec suggests about 1/m)")
    max_depth: int = opt(12, "hard depth cap")
    max_branch: int = opt(8, "most children considered per node")

    @property
    def node_budget(self) -> int:
        return self.budget

    def __post_init__(self):
        super().__post_init__()
        if self.mode not in ("heap", "threshold"):
            raise ValueError("dyspec mode must be 'heap' or 'threshold'")


WINDOW_FIELDS = ("kv_window", "kv_sinks", "kv_evict")  # MethodConfig's cache window


def cache_rows(cfg, held: int, context: int) -> int:
    """The slots a row's key/value caches are allocated with: the ``held`` tokens of its text (prompt
    and generation; at most the ``context``, or with a cache window the window), and room for a tree
    (the engine, and the job driver's memory estimate, jobs/footprint.py)."""
    window = getattr(cfg, "kv_window", 0)
    room = window or context  # (past it, a tree is depth-bound; a wider one grows the caches as it comes)
    return min(held, room) + min(max(cfg.node_budget, 1), room) + 8


SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed")  # SamplingConfig's
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingConfig)}
_WINDOW_DEFAULTS = {f.name: f.default for f in dataclasses.fields(MethodConfig)}


def ar_reference(cfg) -> ARConfig:
    """The ``ar`` whose tokens a method's must equal: plain ``ar`` with the method's sampling
    settings and seed (sampling.py: a sample is a function of the seed) and its cache policy --
    its window and its cache dtype (they change the text; the method must not)."""
    fields = {k: getattr(cfg, k) for k in WINDOW_FIELDS} if getattr(cfg, "kv_window", 0) else {}
    if getattr(cfg, "kv_dtype", "model") != "model":
        fields["kv_dtype"] = cfg.kv_dtype
    if getattr(cfg, "temperature", 0) > 0:
        fields.update({k: getattr(cfg, k) for k in SAMPLING_FIELDS})
    return ARConfig(**fields)


def non_default_options(cfg) -> dict:
    """A method config's fields set away from the method's defaults, as options
    (``make_config(method, them)`` builds the same config)."""
    default = type(cfg)()
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
            if getattr(cfg, f.name) != getattr(default, f.name)}


def _number(x) -> str:
    """A whole number whole (a sample's derived seed read 1.31965e+19: the long-generation trial), others as %g."""
    return str(x) if isinstance(x, int) else f"{x:g}"


def reference_label(ref: ARConfig, seed: bool = True) -> str:
    """How a reference ``ar`` is named in tables: ``ar``, ``ar_window1024`` (``_sinks2_evict16``
    where those differ from their defaults), ``ar_kvbfloat16``, ``ar_t0.6_p0.9_s3`` (sampling:
    temperature, then top_k, top_p, seed where set -- not ``seed`` where each row draws its own), ..."""
    sampled = "".join(f"_{tag}{_number(getattr(ref, name))}" for tag, name in
                      (("t", "temperature"), ("k", "top_k"), ("p", "top_p"), ("s", "seed"))
                      if ref.temperature and getattr(ref, name) != _DEFAULTS[name] and (seed or name != "seed"))
    window = "".join(f"_{tag}{getattr(ref, name)}" for tag, name in (("sinks", "kv_sinks"), ("evict", "kv_evict"))
                     if getattr(ref, name) != _WINDOW_DEFAULTS[name]) if ref.kv_window else ""
    return "ar" + (f"_window{ref.kv_window}{window}" if ref.kv_window else "") + \
        (f"_kv{ref.kv_dtype}" if ref.kv_dtype != "model" else "") + sampled


KERNELS = ("lean", "lean-bf16", "lean-mkl", "hf")  # the engine's forward (models.ModelPair.kernel)
NATIVE_KERNELS = ("lean", "lean-bf16")  # the ones on dynatree's C kernels ("lean-bf16": bfloat16 compute)
# model types dynatree's C forward runs (lean.py: GPT-NeoX; packed.py: the Llama family)
NATIVE_FAMILIES = ("gpt_neox", "llama", "mistral", "qwen2", "qwen3")


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


# The native kernel's packed copy sits beside the model's own weights while it is made: at most a
# quarter of the machine's memory (2 GiB at least), so a 1.7B-parameter bf16 checkpoint loaded as
# float32 (a 3.4 GB copy) packs on a 16 GB machine (native.py, cmodel.refusal; jobs/footprint.py)
MAX_PACKED_BYTES = max(2 * 2**30, _ram_bytes() // 4)
NATIVE_ROWS = 512  # a longer causal forward (a long prompt's prefill) runs in chunks of this many (cmodel)


def within_native_rows(cfg) -> bool:
    """Whether every forward the engine makes for this method config takes the native kernel: its
    longest verified chain (node budget, lookup, root), a causal forward keeping every row's
    logits, fits NATIVE_ROWS (actors/worker.py frees torch's weights only then; jobs/footprint.py)."""
    return cfg.node_budget + cfg.lookup_length + 1 <= NATIVE_ROWS

# parameter bytes for which the torch path keeps a oneDNN-packed float32 copy (lean.can_pack)
MKL_PACK_BYTES = (32 * 2**20, 2 * 2**30)
METHODS: dict[str, type] = {
    "ar": ARConfig,
    "linear": LinearConfig,
    "fixed_tree": FixedTreeConfig,
    "dynatree": DynaTreeConfig,
    "dyspec": DySpecConfig,
}


# a dataclass field's annotation (a string, or each part of "str | None") -> its type: the configs'
# and the job spec's (jobs/spec.py) checks read this one map
ANNOTATION_TYPES = {"int": int, "float": float, "bool": bool, "str": str, "dict": dict, "tuple": tuple,
                    "None": type(None)}


def _coerce(ftype, raw, name: str):
    """An option's value as its field's type: parsed from a string (the CLI), or checked (a job
    file, the Python API) -- a count must be a whole number, a float a real number."""
    t = ftype if isinstance(ftype, type) else ANNOTATION_TYPES.get(str(ftype), str)
    if not isinstance(raw, str):
        return _checked(t, raw, name)
    if t is bool:
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"option {name}: expected true/false, got {raw!r}")
    try:
        return t(raw)
    except ValueError:
        raise ValueError(f"option {name}: expected {t.__name__}, got {raw!r}") from None


def _check_types(cfg) -> None:
    """A config built directly (not by make_config, which converts) holds each field's type:
    else a wrong one fails deep in the engine, or a comparison in __post_init__, with a TypeError."""
    for f in dataclasses.fields(cfg):
        t, v = ANNOTATION_TYPES.get(str(f.type)), getattr(cfg, f.name)
        if t in (bool, str):
            ok = isinstance(v, t)
        elif t in (int, float):  # numpy's numbers too; True is not a count
            ok = not isinstance(v, bool) and isinstance(v, numbers.Integral if t is int else numbers.Real)
        else:
            ok = True
        if not ok:
            raise ValueError(f"option {f.name}: expected {t.__name__}, got {v!r}")


def _checked(t: type, value, name: str):
    if t is bool:
        ok = isinstance(value, bool)
    elif isinstance(value, bool):  # YAML reads `off` / `on` as booleans: words for a str option
        if t is str:
            return "on" if value else "off"
        ok = False
    elif t is int:  # numpy's numbers too (numbers.Integral / Real)
        ok = isinstance(value, numbers.Integral) or isinstance(value, numbers.Real) and float(value).is_integer()
    else:
        ok = isinstance(value, numbers.Real) if t is float else isinstance(value, str)
    if not ok:
        raise ValueError(f"option {name}: expected {t.__name__}, got {value!r}")
    return t(value)


def close_names(words, names) -> list[str]:
    """For each of ``words`` the one of ``names`` it looks like a misspelling of (if any)."""
    import difflib

    names = [n for n in names if isinstance(n, str)]  # (a YAML `method: 3` or `options: {1: 2}` has no spelling)
    return [m[0] for w in words if isinstance(w, str) for m in [difflib.get_close_matches(w, names, n=1, cutoff=0.75)]
            if m]


def did_you_mean(words, names) -> str:
    """" (did you mean X?)" for misspelt ``words`` close to one of ``names``, else ""."""
    close = close_names(words, names)
    return f" (did you mean {', '.join(close)}?)" if close else ""


def make_config(method: str, options: dict | None = None):
    """Build a method config from a dict of overrides (values may be strings from the CLI)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}{did_you_mean([method], METHODS)}; choose one of {', '.join(METHODS)}")
    cls = METHODS[method]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in (options or {}).items():
        if key not in fields:
            known = ", ".join(fields) or "(none)"
            raise ValueError(f"method {method!r} has no option {key!r}{did_you_mean([key], fields)}; its options: {known}")
        kwargs[key] = _coerce(fields[key].type, value, key)
    return cls(**kwargs)  # (its __post_init__ checks the values)


class ContextError(ValueError):
    """The prompt leaves no room in the models' context window."""


def check_window(cfg, context: int, whose: str = "the models'", aside: str = "") -> None:
    """A cache window must fit the context with room for a tree (ContextError); ``whose`` and
    ``aside``: the context's, said in the error (a shorter draft's: ModelPair.window_limit)."""
    window = getattr(cfg, "kv_window", 0)
    if window and window + cfg.kv_evict > context:
        most = context - cfg.kv_evict
        fix = (f"give kv_window at most {most}" if most > cfg.kv_sinks + cfg.kv_evict else
               "lower kv_evict and kv_window together (the window must exceed kv_sinks + kv_evict)")
        raise ContextError(f"kv_window {window} + kv_evict {cfg.kv_evict} exceed {whose} "
                           f"{context}-token context (a draft's tree positions can reach their sum{aside}): {fix}")


def window_limit(cfg, context: int, draft_context: int | None = None) -> tuple[int, str, str]:
    """The context a cache window of ``cfg`` must fit, whose it is and an aside, as check_window says
    them: a drafting method's window is kept in both models (a windowed draft does not restart), so
    a shorter draft's holds it; ``ar`` runs the target alone.  (ModelPair.window_limit, the driver.)"""
    if draft_context and draft_context < context and not isinstance(cfg, ARConfig):
        return (draft_context, "the draft's", "; a drafting method keeps the window in the draft too, while ar's "
                f"may fill the target's {context}")
    return context, "the models'", ""


def check_windows(cfgs: dict, context, build=None) -> None:
    """check_window for each labelled method config of a check or bench, the error naming the
    option to set: ``LABEL.kv_window``, or the bare option for ``ar`` (which a label cannot configure);
    and ``build(cfg)`` (ModelPair.windows), whose ValueError says why the models take no window.
    ``context``: a number, or ``cfg -> (context, whose, aside)`` (ModelPair.window_limit)."""
    for label, cfg in cfgs.items():
        try:
            check_window(cfg, *(context(cfg) if callable(context) else (context,)))
        except ContextError as e:
            raise ContextError(f"{label}: {e} (--option {'' if label == 'ar' else label + '.'}kv_window=N)") from None
        if build is not None and getattr(cfg, "kv_window", 0):
            try:
                build(cfg)
            except ValueError as e:
                raise ValueError(f"{label}: {e}") from None


def grows_trees(cfg) -> bool:
    """Whether the method drafts token trees (not ``ar``'s nothing or ``linear``'s chains): what a
    draft that takes no tree mask cannot serve (ModelPair.method_problem, the job driver)."""
    return not isinstance(cfg, (ARConfig, LinearConfig))


def draws_differ(cfg) -> bool:
    """Whether two draws under ``cfg`` can differ: sampling (temperature > 0) among more than one token."""
    return cfg.temperature > 0 and cfg.top_k != 1


# (switch, value) -> the options a method then never reads (policies.py), and how that is said
_IDLE = {("dynamic_breadth", False): (("b_min", "b_max", "tau_h", "tau_l"), "with dynamic_breadth=False (b_mid children "
                                      "everywhere)"),
         ("dynamic_depth", False): (("rho_stop", "rho_deep"), "with dynamic_depth=False (depth d0 everywhere)"),
         ("history", False): (("window", "hist_high", "hist_low"), "with history=False (no adaptation)"),
         ("mode", "heap"): (("threshold",), "in mode=heap (max_nodes best candidates)")}


def _idle_reasons(cfg) -> list[tuple[tuple[str, ...], str]]:
    """(options, why) of what ``cfg`` leaves unread: sampling at temperature 0, a window's sinks and
    eviction without a window, the options of a switch turned off."""
    out = []
    if getattr(cfg, "temperature", 0) == 0:
        out.append((SAMPLING_FIELDS[1:], "at temperature 0 (greedy decoding); sampling needs a temperature above 0 "
                                         "(e.g. temperature=0.8)"))
    if isinstance(cfg, MethodConfig) and not cfg.kv_window:
        out.append((WINDOW_FIELDS[1:], "without kv_window (no cache window: the whole cache is kept); StreamingLLM's "
                                       "cache needs kv_window=N"))
    out += [idle for (switch, value), idle in _IDLE.items() if getattr(cfg, switch, None) == value]
    return out


def unused_fields(cfg) -> tuple[str, ...]:
    """Options set away from their defaults that change nothing (_idle_reasons): top_k at
    temperature 0, kv_sinks with no kv_window, b_min with dynamic_breadth=False, ..."""
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)} if dataclasses.is_dataclass(cfg) else {}
    return tuple(k for fields, _ in _idle_reasons(cfg) for k in fields
                 if k in defaults and getattr(cfg, k) != defaults[k])


def unused_options(cfg) -> str | None:
    """What to tell a user who set options that change nothing (unused_fields): a run with
    ``top_p=0.9`` alone read as nucleus sampling, one with ``kv_sinks=8`` alone as StreamingLLM's
    cache (the long-generation trial), ``threshold`` beside ``mode=heap`` as a DySpec threshold
    (the fuzzing trial); else None."""
    unused = unused_fields(cfg)
    said = []
    for fields, why in _idle_reasons(cfg):
        set_ = [f"{k}={getattr(cfg, k)}" for k in fields if k in unused]
        if set_:
            said.append(f"{', '.join(set_)} change{'s' if len(set_) == 1 else ''} nothing {why}")
    return "; ".join(said) or None


def unused_options_notes(cfgs: dict) -> list[str]:
    """unused_options for the labelled configs of a bench or check, one note per distinct setting
    naming its methods (an --option given to all of them is said once)."""
    said: dict[str, list[str]] = {}
    for label, cfg in cfgs.items():
        if cfg is not None and (note := unused_options(cfg)):
            said.setdefault(note, []).append(label)
    return [f"{', '.join(labels)}: {note}" for note, labels in said.items()]


def check_samples(cfg, samples) -> int:
    """``samples`` draws per prompt under ``cfg`` (a job's --samples, generate_batch's samples): a
    whole number >= 1, and above 1 only when sampling draws differ (ValueError otherwise)."""
    if not isinstance(samples, numbers.Integral) or isinstance(samples, bool) or samples < 1:
        raise ValueError(f"samples must be a whole number >= 1, got {samples!r}")
    if samples > 1 and not draws_differ(cfg):
        raise ValueError(f"samples={samples} needs sampling (option temperature > 0, top_k not 1): otherwise "
                         "every sample of a prompt would be the same")
    return int(samples)


_AT_LEAST_ONE = ("k", "depth", "branch", "max_nodes", "window", "budget", "max_depth", "max_branch")  # counts and sizes
MAX_COUNT = 2**24  # (no tree, window or text here comes near it; 2**63 overflowed torch's sizes)
MAX_TREE_NODES = 4096  # (a verification's scratch grows with the square of the tree: 100,000 nodes took 40 GB)


def parse_options(pairs: list[str] | tuple[str, ...]) -> dict[str, str]:
    """``["depth=8", "tau=0.1"]`` -> ``{"depth": "8", "tau": "0.1"}``."""
    out = {}
    for p in pairs:
        if "=" not in p:
            raise ValueError(f"option {p!r} is not of the form key=value")
        k, v = p.split("=", 1)
        if k.strip() in out and out[k.strip()] != v.strip():
            raise ValueError(f"option {k.strip()} given twice ({out[k.strip()]} and {v.strip()})")
        out[k.strip()] = v.strip()
    return out


def options_help() -> str:
    """Every method's options: the ones every method (then every drafting method) takes with one
    default listed once, then each method's own."""
    def common(classes) -> list:
        first, rest = classes[0], classes[1:]
        return [f for f in dataclasses.fields(first)
                if all(any(g.name == f.name and g.default == f.default for g in dataclasses.fields(c)) for c in rest)]

    def line(f) -> str:
        return f"    {f.name}={f.default}  {f.metadata.get('help', '')}"

    every = common(list(METHODS.values()))
    drafting = [f for f in common([c for c in METHODS.values() if issubclass(c, SpecConfig)])
                if f.name not in {g.name for g in every}]
    shown = {f.name for f in every + drafting}
    lines = ["every method:", *map(line, every), "every method but ar:", *map(line, drafting)]
    for name, cls in METHODS.items():
        lines.append(f"{name}: {cls.__doc__.strip().splitlines()[0]}")
        lines += [line(f) for f in dataclasses.fields(cls) if f.name not in shown]
    return "\n".join(lines)
