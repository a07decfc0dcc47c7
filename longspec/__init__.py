"""longspec: lossless speculative decoding for long contexts (the LongSpec method)."""
from .config import GenerationConfig, ModelConfig
from .models import TargetModel, load_target

__version__ = "0.1.0"


def __getattr__(name):  # lazy: the engine pulls in the decoding package
    if name in ("Generator", "GenerationOutput"):
        from .decoding import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'longspec' has no attribute {name!r}")


__all__ = ["GenerationConfig", "Generator", "GenerationOutput", "ModelConfig", "TargetModel", "load_target"]
