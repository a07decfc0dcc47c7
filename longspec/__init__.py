"""longspec: lossless speculative decoding for long contexts (the LongSpec method)."""
from .config import GenerationConfig, ModelConfig
from .convert import default_draft_path, default_model_path
from .decoding.sequence import GenerationOutput
from .decoding.generator import Generator
from .decoding.proposers import LongSpecProposer, PromptLookup
from .decoding.streaming import StreamingSelfSpec
from .decoding.tree import TreeSpec
from .models import TargetModel, load_target
from .models.checkpoint import load_draft, save_draft
from .parallel.workers import ParallelGenerator

__version__ = "0.1.0"

__all__ = ["GenerationConfig", "GenerationOutput", "Generator", "LongSpecProposer", "ModelConfig", "ParallelGenerator",
           "PromptLookup",
           "StreamingSelfSpec", "TargetModel", "TreeSpec", "default_draft_path", "default_model_path", "load_draft",
           "load_target", "save_draft"]
