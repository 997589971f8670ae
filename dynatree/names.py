"""Model and dataset names: a local path, or a Hugging Face hub id -- told apart and checked
before anything loads.

Why: a hub id that is not cached on a machine without network costs transformers or datasets
~20-60 s of retries and a long traceback; a path typed wrong looks like a hub id.  Both are found
here in seconds.  Light on purpose (the job driver imports it: no torch, no transformers).
"""
from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

from .config import NATIVE_FAMILIES

_TRUE = ("1", "true", "yes", "on")


def looks_local(name: str) -> bool:
    """Whether a name is meant as a path: a hub id is ``name`` or ``org/name``."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def _offline() -> bool:
    return any(os.environ.get(v, "").lower() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                                                                 "HF_DATASETS_OFFLINE"))


def _cached_config(name: str) -> str | None:
    """The path of hub model ``name``'s config.json in the local Hugging Face cache, or None (never
    downloaded); huggingface_hub's errors pass through (a name that is no repo id: ValueError)."""
    from huggingface_hub import try_to_load_from_cache

    got = try_to_load_from_cache(name, "config.json")
    return got if isinstance(got, str) else None


def local_dir(name: str | Path) -> Path | None:
    """The directory a model's files are in: ``name`` itself, or a hub id's snapshot in the local
    Hugging Face cache; None if neither (never downloaded, or built in memory)."""
    if Path(name).expanduser().is_dir():
        return Path(name).expanduser()
    try:
        got = None if looks_local(str(name)) else _cached_config(str(name))
    except (ImportError, ValueError, OSError):  # (no huggingface_hub; not a valid repo id; an unreadable cache)
        return None
    return Path(got).parent if got else None


def _cached(name: str, kind: str) -> bool:
    """Whether a copy of ``name`` may be cached here (when unsure: yes, and the loader decides)."""
    try:
        from huggingface_hub import constants
    except ImportError:
        return True
    if kind == "model":
        return _cached_config(name) is not None
    if (Path(constants.HF_HUB_CACHE) / f"datasets--{name.replace('/', '--')}").is_dir():
        return True
    try:  # `datasets` keeps its own cache, in folders named after a snake-cased name
        from datasets import config
        from datasets.naming import camelcase_to_snakecase
    except ImportError:
        return True
    base = Path(config.HF_DATASETS_CACHE)
    org, _, ds = name.rpartition("/")
    stems = {name.replace("/", "___"), f"{org}___{camelcase_to_snakecase(ds)}" if org else camelcase_to_snakecase(ds)}
    return any(any(base.glob(stem + "*")) for stem in stems)


def hub_unreachable(timeout_s: float = 5.0) -> bool:
    """Whether the hub's host refused or dropped a TCP connection within ``timeout_s`` (never with
    a proxy configured, which would connect instead of this machine; a DNS lookup that outlasts the
    deadline counts as reachable, so the loader decides)."""
    from urllib.request import getproxies

    if getproxies():
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (80 if url.scheme == "http" else 443)
    failed: list[bool] = []

    def connect() -> None:
        try:
            socket.create_connection((url.hostname, port), timeout=timeout_s).close()
            failed.append(False)
        except OSError:
            failed.append(True)

    probe = threading.Thread(target=connect, daemon=True)
    probe.start()
    probe.join(timeout_s)
    return failed == [True]


def _getter(config):
    """``get(key, default=None)`` over a config object or config.json's dict alike."""
    return config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)


def _rope_kinds(get) -> list[tuple[str | None, dict]]:
    """(rope type, parameters) of each rotary the config sets up: one, or one per layer kind (nested
    dicts); older configs say rope_scaling and "type"."""
    params = get("rope_parameters") or get("rope_scaling") or {}
    kinds = [params] if "rope_type" in params or "type" in params else [p for p in params.values() if isinstance(p, dict)]
    return [(k.get("rope_type") or k.get("type"), k) for k in kinds]


def context_len(config) -> int:
    """Most positions a model takes, from its config (an object, or config.json's dict)."""
    get = _getter(config)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "max_seq_len"):  # (MPT, DBRX: the last)
        v = get(key)
        if isinstance(v, int) and v > 0:
            return v
    return 1 << 30


_QWEN_FULL_LAYERS = 28  # Qwen2/3's default max_window_layers: the layers before it attend to everything


def binding_window(config) -> int | None:
    """The model's own sliding attention window (Mistral, Qwen2/3 with use_sliding_window), or None
    when it has none or it covers the whole context; ``config``: an object, or config.json's dict."""
    get = _getter(config)
    window, kinds = get("sliding_window"), get("layer_types")
    qwen = str(get("model_type") or "").startswith("qwen")  # (gated: use_sliding_window, max_window_layers)
    if kinds is None and qwen:  # (a config.json without layer_types: transformers derives them so)
        first = get("max_window_layers", _QWEN_FULL_LAYERS)
        kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(get("num_hidden_layers") or 0)]
    if (not isinstance(window, int) or window <= 0 or not get("use_sliding_window", not qwen)
            or window >= context_len(config) or (kinds is not None and "sliding_attention" not in kinds)):
        return None
    return int(window)


def rope_switch(config) -> int | None:
    """Where a length-dependent rotary embedding changes its table (LongRoPE: once a forward's
    largest position reaches original_max_position_embeddings it takes its long factors, for every
    row of that forward), or None: a position the engine keeps each forward on one side of."""
    get = _getter(config)
    at = [p.get("original_max_position_embeddings") or get("original_max_position_embeddings")
          for kind, p in _rope_kinds(get) if kind == "longrope"]
    return min((int(a) for a in at if a), default=None)


FIXED_ROPE = ("default", "linear", "llama3", "yarn")  # one table for every length ("dynamic", "longrope" rescale)
NEOX_ACTS = ("gelu", "gelu_new", "relu")  # GPT-NeoX activations the native kernel runs (lean.supports)


def native_refusal(config) -> str:
    """Why the model's config rules out dynatree's native kernel ("" where nothing in it does; the
    load may find more): --kernel lean-bf16, which runs there only, is refused by the job's driver
    from config.json rather than by every actor once loaded (the Llama-family trial)."""
    get = _getter(config)
    kind = get("model_type")
    if kind not in NATIVE_FAMILIES:
        return f"{kind}: neither GPT-NeoX nor a Llama-family model"
    if kind != "llama" and (window := binding_window(config)) is not None:  # (a Llama's stray key reads nothing)
        return f"its {window}-token sliding attention window"
    fixed = ("default",) if kind == "gpt_neox" else FIXED_ROPE
    rescaled = [k for k, _ in _rope_kinds(get) if (k or "default") not in fixed]
    if rescaled:
        return f"its rotary type {rescaled[0]!r}" + (" rescales with the length" if rescaled[0] not in FIXED_ROPE else "")
    if kind == "gpt_neox" and get("hidden_act", "gelu") not in NEOX_ACTS:
        return f"its activation {get('hidden_act')!r}"
    return ""


def no_tree_mask(config) -> str:
    """Why the architecture's attention takes no tree (4-D) mask ("" when nothing says so here):
    transformers' forward fails on a token tree, so as a draft it serves ``linear`` only
    (models._tree_problem finds it by trying; the job driver refuses before any actor starts)."""
    get = _getter(config)
    if get("model_type") == "bloom":
        return "BLOOM's ALiBi attention takes no tree mask"
    if get("model_type") == "falcon" and get("alibi"):
        return "Falcon's ALiBi attention (alibi=true) takes no tree mask"
    return ""


# Models whose generate() recomputes the whole cache with the long factors when a sequence first
# passes its LongRoPE switch (transformers' Phi3ForCausalLM.prepare_inputs_for_generation and its
# copies): their greedy decoding does so here too (engine._Row.resets_rope).
ROPE_RESET = ("phi3", "phimoe", "phi4_multimodal")


def rope_resets(config) -> bool:
    """Whether the model's own decoding recomputes its cache at the LongRoPE switch (ROPE_RESET)."""
    return _getter(config)("model_type") in ROPE_RESET and rope_switch(config) is not None


# Models whose attention rotates the first r dims of each head by halves (rotate_half), which is
# what kvcache.BufferLayer.evict turns back.  GPT-J-style interleaved rotary and absolute positions are not.
ROTATE_HALF = ("gpt_neox", "llama", "mistral", "qwen2", "qwen3", "stablelm", "phi3", "olmo", "olmo2", "granite")
SCALED_ROPE = ("yarn", "longrope")  # rotary types that scale attention (kvcache.make_window checks the module)


def window_refusal(config, window="config") -> str | None:
    """Why a StreamingLLM cache window (kv_window) cannot run on this model, from its config (an
    object, or config.json's dict: a job's driver checks before any actor starts), or None.
    ``window``: the model's own sliding window where the model is at hand (runtime.model_window:
    only an architecture that applies one), else the config's (binding_window)."""
    get = _getter(config)
    if get("model_type") not in ROTATE_HALF:
        return (f"kv_window runs on {', '.join(ROTATE_HALF)} models (rotate-half rotary positions, checked to "
                f"re-rotate exactly when the cache evicts); {get('model_type')!r} is not one of them")
    window = binding_window(config) if window == "config" else window
    if window:  # (its mask is in positions, which eviction moves keys away from)
        return f"kv_window cannot be combined with the model's own {window}-token sliding attention window"
    scaled = [kind for kind, _ in _rope_kinds(get) if kind in SCALED_ROPE]
    if scaled:
        return f"kv_window does not support scaled rotary embeddings (rope_type {scaled[0]!r})"
    return None


def model_config(name: str | Path) -> dict | None:
    """A model's config.json as a dict: a local directory's, or a hub id's copy in the local
    Hugging Face cache (never downloaded) -- what a job's driver checks before any actor starts;
    None where there is none to read, or it is not a JSON object (the model's load says why)."""
    where = local_dir(name)
    if where is None or not (where / "config.json").is_file():
        return None
    try:
        config = json.loads((where / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def model_problem(name: str) -> str | None:
    """Why ``name`` cannot be loaded here, or None: a local-looking path that does not exist, a
    directory without a config.json or weights (refused in a job's driver, not ~20 s later in its
    actors: the own-models trial), or a hub id that is neither cached nor reachable (:func:`hub_problem`)."""
    path = Path(name).expanduser()
    if looks_local(name) and not path.exists():
        return "no such file or directory"
    if path.is_dir() and not (path / "config.json").is_file():
        return "no config.json in this directory (not a saved model: save_pretrained writes one)"
    if path.is_dir() and not any((path / f).is_file() for f in WEIGHT_FILES):
        return f"no weights in this directory (none of {', '.join(WEIGHT_FILES)})"
    problem = hub_problem(name)
    return f"no such file or directory, and as a hub id {problem}" if problem else None


def hub_problem(name: str, kind: str = "model") -> str | None:
    """Why ``name``, not a local path, cannot load from the hub here as a "model" or "dataset" (not
    cached, and the hub does not answer: the loaders would retry for 20-60 s), or None if it may.
    In offline mode the loaders fail fast on their own (or find a copy this check cannot see)."""
    if looks_local(name) or Path(name).expanduser().exists() or _offline() or _cached(name, kind):
        return None
    if hub_unreachable():
        return (f"not in the Hugging Face cache, and the hub ({os.environ.get('HF_ENDPOINT', 'huggingface.co')}) "
                "is unreachable from this machine (with a cached copy, HF_HUB_OFFLINE=1 uses it)")
    return None


def default_pair_dir() -> Path:
    """The demo pair bundled inside the package (see ``dynatree/assets``)."""
    return Path(__file__).parent / "assets" / "demo-pair"


def model_files(name: str | None, role: str = "target") -> list | None:
    """(file, size, mtime_ns) of a local model directory's configs and weights -- what changes
    when a model is retrained in place; ``name`` None is the demo pair's ``role``; None for a
    hub id (its name is all there is to compare)."""
    path = Path(name).expanduser() if name else default_pair_dir() / role
    if not path.is_dir():
        return None
    return [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(path.iterdir())
            if f.suffix in (".json", ".safetensors", ".bin")]


def safetensors_files(path: str | Path) -> list[Path]:
    """The safetensors files transformers would read: the index's shards, else model.safetensors."""
    p = Path(path)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError):
            return []
        return [p / f for f in shards]
    return [p / "model.safetensors"] if (p / "model.safetensors").is_file() else []


SKIP = (".inv_freq", ".masked_bias", ".attention.bias")  # buffers older transformers saved; recomputed


# the files a tokenizer is built from (tokenizer_config.json alone is not one: transformers then
# builds an empty tokenizer that encodes every text to nothing)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")


def lacks_tokenizer(path: str | Path) -> bool:
    """Whether a local model directory holds none of TOKENIZER_FILES (a hub id: unknown, False)."""
    p = Path(path)
    return p.is_dir() and not any((p / f).is_file() for f in TOKENIZER_FILES)
