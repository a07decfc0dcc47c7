"""longspec: lossless speculative decoding for long contexts (the LongSpec method).

The public names below load on first use (PEP 562), so ``longspec --version`` and ``--help``
answer without importing PyTorch."""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "GenerationConfig": ".config", "ModelConfig": ".config",
    "default_draft_path": ".convert", "default_model_path": ".convert",
    "GenerationOutput": ".engine.sequence", "Generator": ".decoding.generator",
    "LongSpecProposer": ".spec.proposers", "PromptLookup": ".spec.proposers",
    "StreamingSelfSpec": ".spec.streaming", "TreeSpec": ".spec.tree",
    "TargetModel": ".models", "load_target": ".models",
    "load_draft": ".models.checkpoint", "save_draft": ".models.checkpoint",
    "ParallelGenerator": ".parallel.workers",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'longspec' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)  # (not kept: a patch of it shows)


def __dir__() -> list:
    return sorted({*globals(), *_EXPORTS})
