"""The layer search's variants (op ``attention_layer``), one block each: its space, when it applies,
its static checks, its default and its registration.

Launch signature: ``launch(q1, k, cache_position, attention_mask, settings, config) -> Found`` (the
anchors [B, Hq, Lq, topk] and their scores); the layer's spans, span attention and gate run by their
own ops' dispatch (``ops.layer``).
"""

from __future__ import annotations

from ...buckets import next_power_of_two
from ...launch import KernelConfig
from ...problem import ATTENTION_LAYER, Problem
from ...registry import Param, Variant
from ...settings import SpanSettings
from ..rules import MAX_TC_VALUES_PER_THREAD, always_applies, no_check, reference_default, triton_reasons
from .reference import search_reference


def search_reasons(problem: Problem) -> list[str]:
    """Why the Triton layer searches cannot serve ``problem``."""
    reasons = triton_reasons(problem)
    if problem.spans > 64:
        reasons.append(f"topk = {problem.spans} > 64 kept scores per query")
    return reasons


def search_registers_reason(problem: Problem, config: KernelConfig, rows: int, cols: int, key_rows: int) -> str | None:
    """What both layer searches check: heads past the group, or registers (GPU only): the ``rows``'
    Q1 (16-bit pairs), their scores against ``cols`` columns, the kept top-k, and ``key_rows``
    prefetched key rows (16-bit pairs)."""
    if config.block_h > next_power_of_two(problem.rep):
        return f"block_h {config.block_h} > the {problem.rep} query heads of a KV group"
    if not problem.device.is_gpu:
        return None
    half_d = next_power_of_two(problem.head_dim) // 2
    values = rows * (half_d + cols + 2 * next_power_of_two(problem.spans)) + key_rows * half_d
    if values / (32 * config.num_warps) > MAX_TC_VALUES_PER_THREAD:
        return f"registers: about {values / (32 * config.num_warps):.0f} values per thread (limit {MAX_TC_VALUES_PER_THREAD})"
    return None


# --- attention_layer/stripe_tiles ----------------------------------------------------------------

STRIPE_TILE_SPACE = (  # each query's heads against a tile of its stripe keys: one dot per tile
    Param("block_s", (16, 32, 64, 128)),
    Param("block_h", (1, 2, 4, 8, 16)),
    Param("block_q", (1, 2, 4, 8, 16)),
    Param("num_warps", (1, 2, 4, 8)),
)


def stripe_tile_check(problem: Problem, config: KernelConfig) -> str | None:
    """Why a stripe-tile search configuration cannot run well: dots under 16 rows or columns, more
    queries than needed at 16 heads, or ``search_registers_reason`` (its block_q x block_s columns
    are the prefetched stripe keys)."""
    rows, cols = config.block_q * config.block_h, config.block_q * config.block_s
    if rows < 16 or cols < 16:
        return f"block_q * block_h = {rows} rows and block_q * block_s = {cols} columns: a tensor-core dot needs 16 of each"
    if config.block_q > 1 and config.block_h >= 16:
        return f"block_q {config.block_q} with block_h {config.block_h}: 16 heads already fill the dot's rows"
    return search_registers_reason(problem, config, rows, cols, cols)


def stripe_tile_default(problem: Problem) -> KernelConfig:
    """Heuristic stripe-tile search tiles: up to 16 heads of a group and as many queries as make 16
    rows, 16 stripes per query, one warp (two past D = 128; at model M more warps and wider stripe
    tiles were slower), with as many more warps as the register estimate asks for."""
    block_h = min(16, next_power_of_two(problem.rep))
    config = KernelConfig(block_s=16, block_h=block_h, block_q=max(1, 16 // block_h),
                          num_warps=1 if problem.head_dim <= 128 else 2)
    while stripe_tile_check(problem, config) is not None and config.num_warps < 8:  # wide tiles: more warps
        config = config.replace(num_warps=2 * config.num_warps)
    return config


def stripe_tile_search(q1, k, cache_position, attention_mask, settings: SpanSettings, config: KernelConfig):
    """The layer's Triton stripe search over tiles of stripes."""
    from .stripe_tile_search import stripe_tile_search as search

    return search(q1, k, cache_position, attention_mask, settings, config)


STRIPE_TILES = Variant(
    op=ATTENTION_LAYER, name="stripe_tiles", launch=stripe_tile_search, space=STRIPE_TILE_SPACE, reasons=search_reasons,
    compile_check=stripe_tile_check, default=stripe_tile_default, priority=0,  # faster than tiled_search wherever measured
    description="Triton stripe search over tiles of stripes: each query's heads scored against a tile of its stripe "
    "keys by one tensor-core dot (no product wasted at 16 heads per KV group); top-k in registers",
)

# --- attention_layer/tiled_search ----------------------------------------------------------------

SEARCH_SPACE = (  # queries and heads of one KV group per program
    Param("block_q", (16, 32, 64)),
    Param("block_h", (1, 2, 4, 8, 16)),
    Param("num_warps", (4, 8)),
    Param("num_stages", (1, 2, 3)),
)


def search_check(problem: Problem, config: KernelConfig) -> str | None:
    """Why a ``tiled_search`` configuration cannot run well (``search_registers_reason``: its rows are
    block_h x block_q (head, query) pairs, scored against the block's block_q keys)."""
    return search_registers_reason(problem, config, config.block_h * config.block_q, config.block_q, 0)


def search_default(problem: Problem) -> KernelConfig:
    """Heuristic search tiles: 16 queries of up to 8 heads of a group per program (a 128-row dot),
    4 warps (8 past D = 128), 2 stages."""
    return KernelConfig(block_q=16, block_h=min(8, next_power_of_two(problem.rep)),
                        num_warps=4 if problem.head_dim <= 128 else 8, num_stages=2)


def tiled_search(q1, k, cache_position, attention_mask, settings: SpanSettings, config: KernelConfig):
    """The layer's Triton stripe search."""
    from .tiled_search import tiled_search as search

    return search(q1, k, cache_position, attention_mask, settings, config)


TILED_SEARCH = Variant(
    op=ATTENTION_LAYER, name="tiled_search", launch=tiled_search, space=SEARCH_SPACE, reasons=search_reasons,
    compile_check=search_check, default=search_default, priority=1,
    description="Triton stripe search: per stripe, one gathered key row per query scored against several heads' "
    "rows by one tensor-core dot (its diagonal); top-k in registers; spans and window by the span ops' dispatch",
)

# --- attention_layer/reference -------------------------------------------------------------------

SEARCH_REFERENCE = Variant(
    op=ATTENTION_LAYER, name="reference", launch=search_reference, space=(), reasons=always_applies,
    compile_check=no_check, default=reference_default, priority=100,
    description="PyTorch stripe search (scores gathered in query chunks, stable sort for the ties); CPU, float64 "
    "and fallback",
)

VARIANTS: tuple[Variant, ...] = (STRIPE_TILES, TILED_SEARCH, SEARCH_REFERENCE)
