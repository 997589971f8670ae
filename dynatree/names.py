"""Model and dataset names: a local path, or a Hugging Face hub id -- told apart and checked
before anything loads.

Why: a hub id that is not cached on a machine without network costs transformers or datasets
~20-60 s of retries and a long traceback; a path typed wrong looks like a hub id.  Both are found
here in seconds.  Light on purpose (the job driver imports it: no torch, no transformers).
"""
from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse

_TRUE = ("1", "true", "yes", "on")


def looks_local(name: str) -> bool:
    """Whether a name is meant as a path: a hub id is ``name`` or ``org/name``."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def _offline() -> bool:
    return any(os.environ.get(v, "").lower() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                                                                 "HF_DATASETS_OFFLINE"))


def _cached(name: str, kind: str) -> bool:
    if kind == "model":
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:
            return True  # cannot tell: let the loader decide
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    base = Path(os.environ.get("HF_DATASETS_CACHE", Path.home() / ".cache" / "huggingface" / "datasets"))
    return any(base.glob(name.replace("/", "___") + "*"))


def hub_unreachable(timeout_s: float = 5.0) -> bool:
    """Whether the hub's host takes no TCP connection (never with a proxy configured: the proxy,
    not this machine, would connect)."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout_s).close()
    except OSError:
        return True
    return False


def hub_problem(name: str, kind: str = "model") -> str | None:
    """Why ``name``, not a local path, cannot load from the hub here as a "model" or "dataset" (not
    cached, and the hub out of reach: offline mode or no connection), or None if it may."""
    if looks_local(name) or Path(name).expanduser().exists() or _cached(name, kind):
        return None
    if _offline():
        return "not in the Hugging Face cache, and offline mode is set"
    if hub_unreachable():
        return (f"not in the Hugging Face cache, and the hub ({os.environ.get('HF_ENDPOINT', 'huggingface.co')}) "
                "is unreachable from this machine")
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
