"""dynatree: exact tree speculative decoding (DynaTree, DySpec) for offline batch generation.

The public names load on first use (PEP 562), so the job driver — which plans shards and writes
Parquet but never touches tensors — imports neither torch nor transformers."""
from importlib import import_module
from pathlib import Path as _Path

__version__ = "0.1.0"

# A checkout has actors/ and jobs/ beside this package (an installed one has them inside it, as
# pyproject.toml maps them): served from beside it, so the copy `ray job submit --working-dir .`
# ships runs its own driver and actors, not the ones a node installed.
_ROOT = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).parent / "jobs").exists() and (_ROOT / "jobs" / "driver.py").is_file():
    __path__.append(str(_ROOT))
_WHERE = {"METHODS": "config", "make_config": "config", "parse_options": "config",
          "BatchDecoder": "engine", "ContextError": "config", "Generation": "engine", "decode": "engine",
          "decode_batch": "engine", "generate": "engine", "generate_batch": "engine",
          "ModelPair": "models", "PairError": "models", "load_pair": "models", "pair_from_models": "models",
          "Stop": "stops"}
__all__ = sorted(_WHERE) + ["__version__"]


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
