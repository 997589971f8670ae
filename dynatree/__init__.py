"""dynatree: exact tree speculative decoding (DynaTree, DySpec) for offline batch generation.

The public names load on first use (PEP 562), so the job driver — which plans shards and writes
Parquet but never touches tensors — imports neither torch nor transformers."""
from importlib import import_module
from pathlib import Path as _Path

__version__ = "0.1.0"


class _Beside:
    """In a checkout, dynatree.jobs and dynatree.actors are the jobs/ and actors/ beside this
    package (pyproject.toml maps them so; an installed copy has them inside it).  Found here
    first, so the copy `ray job submit --working-dir .` ships runs its own driver and actors, not
    the ones a node installed (whose editable finder would map the names there)."""

    def __init__(self, root: _Path):
        self.dirs = {f"{__name__}.{sub}": root / sub for sub in ("jobs", "actors")}

    def find_spec(self, name, path=None, target=None):
        where = self.dirs.get(name)
        if where is None:
            return None
        from importlib.util import spec_from_file_location
        return spec_from_file_location(name, where / "__init__.py", submodule_search_locations=[str(where)])


def _checkout_root() -> _Path | None:
    """The checkout this package sits in: its pyproject.toml maps jobs/ and actors/ into it."""
    here = _Path(__file__).resolve().parent
    root = here.parent
    if (here / "jobs").exists() or not (root / "jobs" / "__init__.py").is_file():
        return None
    try:
        return root if '"dynatree.jobs" = "jobs"' in (root / "pyproject.toml").read_text() else None
    except OSError:
        return None


def _serve_checkout() -> None:
    import sys

    root = _checkout_root()
    if root is not None and not any(isinstance(f, _Beside) for f in sys.meta_path):
        sys.meta_path.insert(0, _Beside(root))


_serve_checkout()
_WHERE = {"METHODS": "config", "make_config": "config", "parse_options": "config", "options_help": "config",
          "BatchDecoder": "engine", "ContextError": "config", "Generation": "engine", "decode": "engine",
          "decode_batch": "engine", "generate": "engine", "generate_batch": "engine",
          "ModelPair": "models", "PairError": "models", "load_pair": "models", "pair_from_models": "models",
          "Stop": "stops"}
__all__ = sorted(_WHERE) + ["__version__"]


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The lazy public names too (tab completion, help(); the module's globals alone hide them)."""
    return sorted({*globals(), *__all__})
