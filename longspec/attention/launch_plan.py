"""Launch planning of the Triton attention kernels (``triton_kernels.py``): the launch
parameters (:class:`KernelConfig`), the tile sizes a head dim allows (shared memory and
registers of one program) and the split-KV plan. Plain Python: importable without Triton."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of the partial kernel. ``block_q``: packed query rows per tile (0: the
    rows rounded up to a power of two, at most 128); ``programs``: how many programs the split-KV
    plan fills at most (0: the device's multiprocessors times ``per_sm``, 0 there meaning
    :func:`programs_per_sm`'s choice: 1, the fastest for trees and for decode at short contexts,
    more for small tiles over a long cache, docs/benchmarks.md);
    ``min_chunk``: keys per split-KV program at least (short caches: fewer, longer programs)."""

    block_q: int = 0
    block_n: int = 64
    num_warps: int = 0  # 0: 4 for tiles of <= 64 rows, else 8
    num_stages: int = 0  # 0: Triton's default
    programs: int = 0
    per_sm: int = 0
    merge_elements: int = 4096  # partial-output elements a merge program loads at once (see merge_plan)
    min_chunk: int = 128
    # the unmasked loop loads K/V through tensor-memory-accelerator descriptors; None: for tiles of 128
    # rows, and a tree's WIDE_HEAD_TILE-row tiles of heads of at most 64 dimensions, on Hopper or newer
    # (2-4% faster there from M=32 x 4 heads; not for decode's small tiles)
    tma: Optional[bool] = None
    # a tree's whole attention (prefix and tree part) in the warp-specialized Hopper kernel
    # (hopper_tree.py) where it applies; None: over a cache of hopper_tree.MIN_KEYS keys or more,
    # for rows where it pays (hopper_tree.pays; where it was measured)
    hopper: Optional[bool] = None
    # loop variants timed and removed, none faster (docs/benchmarks.md, "Hybrid tree attention"): the
    # next block's q.k before this block's softmax, lazy rescaling, extra rows riding along full
    # tiles, Triton's automatic warp specialization of the unmasked loop


# rows of a tile for a tree's many rows where heads have at most 64 dimensions: 4 warps of 64-row
# tiles, two programs per multiprocessor where the cache is long (:func:`programs_per_sm`), are
# faster there than 128-row tiles of 8 warps, from short caches to 1M keys (docs/benchmarks.md,
# "Hybrid tree attention"); at 128 dimensions the 128-row tiles stay best
WIDE_HEAD_TILE = 64
WIDE_CHUNK = 512  # keys a program of such tiles streams at one program per SM, from which two share each SM


def wide_head_tiles(rows: int, head_dim: int, block_q: int = WIDE_HEAD_TILE) -> bool:
    """Whether a launch of ``rows`` packed rows per KV head in tiles of ``block_q`` runs a tree's
    :data:`WIDE_HEAD_TILE`-row tiles of heads of at most 64 dimensions (their own programs per
    multiprocessor and TMA loads)."""
    return block_q == WIDE_HEAD_TILE and head_dim <= 64 and rows > WIDE_HEAD_TILE


# shared memory one program may use: a Hopper GPU's 227 KB per block, less room for Triton's own
# scratch (the estimate below counts the tiles only)
SHARED_MEMORY_BUDGET = 200 * 1024
ACC_ELEMENTS_PER_THREAD = 64  # float32 accumulator registers per thread at most (the rest: q, scores, addresses)


def shared_memory_bytes(block_q: int, block_n: int, head_dim: int, elem_size: int, stages: int) -> int:
    """Shared memory of one program of the partial kernel: the query tile, ``stages`` buffered K
    and V blocks (Triton's software pipeline) and the probabilities fed to the second product."""
    return elem_size * (block_q * head_dim + 2 * stages * block_n * head_dim + block_q * block_n)


def tile_plan(c: KernelConfig, rows: int, head_dim: int, elem_size: int, budget: int = SHARED_MEMORY_BUDGET) -> tuple:
    """(block_q, block_n, num_warps, num_stages) of a launch: the config's, made legal for large
    head dims. The float32 accumulator [block_q, head_dim] stays within
    ``ACC_ELEMENTS_PER_THREAD`` registers per thread of 8 warps (head_dim 256: at most 64 rows),
    and the tiles within ``budget`` bytes (smaller key blocks first, then fewer pipeline
    stages, then fewer rows). ``num_stages`` 0: Triton's default (3 on Hopper), counted as 3.
    ``block_q`` 0: the rows rounded up to a power of two, at most 128, but tiles of
    :data:`WIDE_HEAD_TILE` rows for heads of at most 64 dimensions (a tree's many rows: see there)."""
    block_q = c.block_q or (WIDE_HEAD_TILE if wide_head_tiles(rows, head_dim)
                            else max(16, min(128, next_power_of_2(rows))))
    block_q = max(16, min(block_q, 8 * 32 * ACC_ELEMENTS_PER_THREAD // head_dim))
    block_n, stages = c.block_n, c.num_stages
    while shared_memory_bytes(block_q, block_n, head_dim, elem_size, stages or 3) > budget:
        if block_n > 32:
            block_n //= 2
        elif (stages or 3) > 2:
            stages = 2
        elif block_q > 16:
            block_q //= 2
        elif block_n > 16:
            block_n //= 2
        else:
            stages = 1
            break
    warps = c.num_warps or (4 if block_q * head_dim <= 4 * 32 * ACC_ELEMENTS_PER_THREAD and block_q <= 64 else 8)
    return block_q, block_n, warps, stages


def merge_plan(n_parts: int, rows: int, head_dim: int, elements: int, units: int = 1, programs: int = 132) -> tuple:
    """(parts, block_r) of the merge kernel: each program loads ``parts`` partial outputs of
    ``block_r`` rows at once. Where 16-row programs alone fill half the device (``units`` (row,
    KV head) pairs, ``programs`` multiprocessors), one part at a time in 16-row programs (many
    loads in flight already); else [parts, block_r, head_dim] within ``elements``: all the parts
    where they fit, one round trip to memory instead of one a part (a step's few rows over many
    parts). Timings: ``bench_attention.py --merge`` (docs/benchmarks.md)."""
    if units * -(-rows // 16) >= programs // 2:
        return 1, 16
    parts = min(next_power_of_2(n_parts), max(1, elements // head_dim))
    return parts, max(1, min(next_power_of_2(rows), elements // (parts * head_dim)))


def shared_memory_budget(block_limit: int) -> int:
    """The tiles' budget on a GPU whose blocks may use ``block_limit`` bytes of shared memory (its
    opt-in maximum): 7/8 of it (room for Triton's own scratch), at most ``SHARED_MEMORY_BUDGET``.
    A consumer GPU (about 99 KB a block) gets smaller tiles than a Hopper data-centre GPU (227 KB)."""
    return min(SHARED_MEMORY_BUDGET, block_limit * 7 // 8) if block_limit > 0 else SHARED_MEMORY_BUDGET


LONG_CHUNK = 16384  # keys a program of small tiles streams at most before more programs share each SM


def programs_per_sm(capacity: int, units: int, block_q: int, multiprocessors: int = 132, wide: bool = False) -> int:
    """Split-KV programs per multiprocessor where the config leaves it open: 1, except for small
    tiles (at most 32 rows: decode's few rows) over a cache so long that one program per
    multiprocessor would stream more than LONG_CHUNK keys: then up to 4, each a shorter chunk
    (small programs share a multiprocessor, so it keeps more key blocks in flight: a decode step's
    attention at 1M keys, 8 KV heads of 64: 1.5x faster, at the bandwidth floor); and for a tree's
    wide-head tiles (``wide``: :func:`wide_head_tiles`), 2 where one program per multiprocessor
    would stream WIDE_CHUNK keys or more. At short contexts one program per multiprocessor stays
    best (more parts cost their merge)."""
    chunk = capacity / max(1, multiprocessors // max(units, 1))
    if wide:
        return 2 if chunk >= WIDE_CHUNK else 1
    if block_q > 32:
        return 1
    return int(min(4, max(1, -(-chunk // LONG_CHUNK))))


def plan(capacity: int, units: int, block_n: int = 64, programs: int = 132, min_chunk: int = 128) -> tuple:
    """(n_splits, chunk) for a cache of ``capacity`` slots shared by ``units`` (row tile, KV head,
    sequence) triples: at most ``programs`` programs in all where the cache is long enough (one
    full wave: a second, partial one would leave most multiprocessors idle), chunks of at least
    ``min_chunk`` keys, a multiple of ``block_n``."""
    want = max(1, programs // units)
    chunk = max(-(-capacity // want), min_chunk, 1)
    chunk = -(-chunk // block_n) * block_n
    return max(1, -(-capacity // chunk)), chunk
