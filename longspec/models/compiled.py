"""Fixed-shape steps through ``torch.compile``: :func:`compile_step` (static shapes, Inductor
unless ``LONGSPEC_COMPILE_BACKEND`` names another backend, uncompiled with a warning where
compilation is not possible), the compiled functions a :class:`~longspec.models.target.TargetModel`
step runs (its inputs, :func:`compiled_inputs`, and one decoder layer, :func:`compiled_layer`:
each compiled once per process), and :func:`compile_counts`, what has been compiled so far. The
engine and the draft's training loss compile their own steps through :func:`compile_step`.
Apart from the model: the machinery of compilation, not what a step computes.
"""
from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Optional

import torch

from ..attention import ops
from ..compile_boundary import mark_compile_boundaries, shorten_compile_failures
from ..kv.cache import KVCache
from .layers import run_layer

if TYPE_CHECKING:
    from .target import TargetModel


_COMPILED: dict = {}


def compile_step(fn):
    """``torch.compile`` as fixed-shape steps use it: static shapes, Inductor (the environment
    variable ``LONGSPEC_COMPILE_BACKEND`` picks another backend, e.g. ``aot_eager`` in CPU tests).
    Each new shape compiles once (seconds); the recompilation limit is raised for the few shapes
    an engine uses (decode, verify, each draft level, each batch size). Where compilation is not
    possible (no Triton for Inductor, an unsupported Python, a compiler error) the step runs
    uncompiled, with a warning: the same results, slower."""
    import torch._dynamo

    mark_compile_boundaries()
    shorten_compile_failures()

    ops.register()  # (after the boundaries: the attention kernels become operators, not graph breaks)
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 64)
    try:
        compiled = torch.compile(fn, dynamic=False, backend=os.environ.get("LONGSPEC_COMPILE_BACKEND", "inductor"),
                                 mode=os.environ.get("LONGSPEC_COMPILE_MODE"))
    except RuntimeError as err:  # e.g. Dynamo does not support this Python version
        _compile_failed(err)
        return fn

    def step(*args, **kwargs):
        # a frame that fails to compile runs eagerly (Dynamo's own fallback: nothing runs twice)
        with torch._dynamo.config.patch(suppress_errors=True):
            return compiled(*args, **kwargs)

    return step


def compile_counts() -> dict:
    """What ``torch.compile`` has made in this process so far: ``graphs`` (Dynamo's), ``loaded``
    (taken whole from the on-disk cache: AOTAutograd cache hits), ``traced`` (traced again by
    AOTAutograd: its cache missed, or cannot hold the graph) and ``compiled`` (code Inductor
    generated: missed by its FX graph cache, or not cacheable). All 0 before anything is compiled;
    ``loaded`` and ``traced`` stay 0 for backends other than Inductor."""
    utils = sys.modules.get("torch._dynamo.utils")  # (not imported: nothing compiled; importing costs seconds)
    if utils is None:
        return dict.fromkeys(("graphs", "loaded", "traced", "compiled"), 0)
    aot, counters = utils.counters["aot_autograd"], utils.counters
    return {"graphs": counters["stats"]["unique_graphs"], "loaded": aot["autograd_cache_hit"],
            "traced": aot["autograd_cache_miss"] + aot["autograd_cache_bypass"],
            "compiled": counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_bypass"]}


def _compile_failed(err: Exception) -> None:
    import warnings

    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    warnings.warn(f"torch.compile is not available here, steps run uncompiled ({first_line})", stacklevel=3)


def step_inputs(model: "TargetModel", input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                rope_seq_len: Optional[torch.Tensor]) -> tuple:
    """What a step's layers take besides the cache: the embeddings [B, T, H], the rotary tables
    (cos, sin) [B, T, D] of the full-attention layers and of the sliding ones (the same pair where
    they share one), in the model's dtype, and the new tokens' physical slots [B, T]."""
    x = model.embed(input_ids)
    rope = tuple(c.to(x.dtype) for c in model.rotary(positions, rope_seq_len))
    local = rope
    if model.config.has_sliding_layers and model.rotary_local is not model.rotary:
        local = tuple(c.to(x.dtype) for c in model.rotary_local(positions, rope_seq_len))
    return x, rope, local, cache.physical(cache.new_slots(input_ids.shape[1]))


def compiled_inputs():
    """:func:`step_inputs` through :func:`compile_step`: a few kernels a step instead of a small
    one for each operation (the slots' arithmetic, the table lookup, the rotary tables'
    trigonometry and casts), which a captured step replays one after another."""
    if "inputs" not in _COMPILED:
        _COMPILED["inputs"] = compile_step(step_inputs)
    return _COMPILED["inputs"]


def compiled_layer():
    """``run_layer`` through :func:`compile_step`: Inductor fuses the norms, RoPE, the cache write,
    the attention's softmax and SwiGLU into a few kernels (matrix products stay cuBLAS); one
    compiled version per step shape serves every layer of every model."""
    if "layer" not in _COMPILED:
        _COMPILED["layer"] = compile_step(run_layer)
    return _COMPILED["layer"]
