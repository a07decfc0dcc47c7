from .checkpoint import load_target
from .target import TargetModel

__all__ = ["TargetModel", "load_target"]
