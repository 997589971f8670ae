"""dynatree: exact tree speculative decoding (DynaTree, DySpec) for offline batch generation."""
from .config import METHODS, make_config, parse_options
from .engine import BatchDecoder, ContextError, Generation, decode, decode_batch, generate, generate_batch
from .models import ModelPair, PairError, load_pair, pair_from_models

__version__ = "0.1.0"
__all__ = ["METHODS", "BatchDecoder", "ContextError", "Generation", "ModelPair", "PairError", "decode", "decode_batch",
           "generate", "generate_batch",
           "load_pair", "make_config", "pair_from_models", "parse_options", "__version__"]
