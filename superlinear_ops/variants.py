"""Declarations of every kernel variant (adding a variant is one ``REGISTRY.register`` here).

Launch signatures by op:
- span_forward:  launch(geo: LaunchGeometry, config) -> (out [B,Hq,Lq,K,D], lse2 [B,Hq,Lq,K])
- span_backward: launch(geo, config, out, lse2, grad_out) -> (dQ, dK, dV)
- staged_decode: launch(q1, q2, k, v, cache_position, attention_mask, settings, config) -> out
- attention_layer: launch(q1, k, cache_position, attention_mask, settings, config) -> anchors
  [B, Hq, Lq, topk] (the layer's search; its spans run by the span ops' own dispatch, ``layer``)
- gate_scores: launch(q1, k, anchors, config) -> scores [B, Hq, Lq, topk]; gate_scores_backward:
  launch(q1, k, anchors, grad, config) -> (dQ1, dK); gate: launch(scores, span_out, dtype, config) ->
  out [B, Hq, Lq, D]; gate_backward: launch(scores, span_out, grad, config) -> (d scores, d span_out)
  (the layer's gate, ``layer.attention``)
``config`` is a ``KernelConfig`` holding exactly the names of the variant's declared ``space``.
Each op also has a PyTorch-reference variant last in priority: the fallback that always works
(CPU tensors, float64). The rules the declarations use (when a variant applies, its static
checks, its defaults) are in ``variant_rules``.
"""

from __future__ import annotations

from functools import partial

import torch

from .arch_check import with_compiled
from .decode.grouped import group_spans_decode, grouped_decode, stripe_spans_decode
from .decode.split_window import split_window_decode
from .decode.staged import staged_decode
from .kernels.launch import KernelConfig, LaunchGeometry
from .layer import attention as gate_paths
from .layer.gate_ops import GATE, GATE_BACKWARD, GATE_SCORES, GATE_SCORES_BACKWARD
from .layer.search import search_reference
from .ops import BUILTIN as BUILTIN_OPS
from .problem import ATTENTION_LAYER, SPAN_BACKWARD, SPAN_FORWARD, STAGED_DECODE, Problem
from .reference import span_backward_reference, span_forward_reference
from .registry import REGISTRY, Param, Variant
from .settings import SpanSettings
from .variant_rules import (
    BACKWARD_TILES,
    FORWARD_TILES,
    always_applies,
    backward_default,
    forward_default,
    fused_reasons,
    gate_default,
    group_spans_check,
    group_spans_default,
    group_spans_reasons,
    grouped_check,
    grouped_default,
    grouped_reasons,
    no_check,
    reference_default,
    reference_reasons,
    resource_check,
    rows_check,
    search_check,
    search_default,
    search_reasons,
    split_reasons,
    stripe_spans_check,
    stripe_spans_default,
    stripe_spans_reasons,
    stripe_tile_check,
    stripe_tile_default,
    tc_backward_default,
    tc_forward_default,
    tc_reasons,
    tile_check,
    triton_reasons,
)

KEY_BLOCKS = Param("block_k", (16, 32, 64, 128, 256))
WARPS = Param("num_warps", (1, 2, 4, 8))
FORWARD_SPACE = (KEY_BLOCKS, WARPS, Param("num_stages", (1, 2, 3, 4)))
BACKWARD_SPACE = (Param("block_k", (16, 32, 64, 128)), WARPS, Param("num_stages", (1, 2, 3)))
# The chunked decodes stream one query's keys: a deeper pipeline keeps more K/V loads in flight per program
# (the H200's 64K and masked winners chose 4 stages, the deepest FORWARD_SPACE declares).
DECODE_TILES = (KEY_BLOCKS, WARPS, Param("num_stages", (1, 2, 3, 4, 6, 8)))
# Keys per span program: powers of two and steps between them (equal pieces of a span, e.g. 448 = 1,785 / 4 at
# model M's 64K). On the H200 the tuner's confirmed winners stayed powers of two (2048 at 1M, session 19).
GROUPED_SPACE = (*DECODE_TILES, Param("chunk", (128, 192, 256, 384, 448, 512, 768, 896, 1024, 1536, 2048, 3072, 4096)))
# Keys per chunk of key positions (group_spans): one program walks several; a chunk reads its span keys once.
GROUP_SPANS_SPACE = (*DECODE_TILES, Param("chunk", (64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 8192)))
STRIPE_SPANS_SPACE = (*DECODE_TILES, Param("chunk", (64, 96, 128, 192, 256, 384, 512, 1024, 2048, 4096)))
TC_SPACE = (  # the window kernels' tiles, then the span-tile kernel's (forward and backward)
    Param("window_block_m", (32, 64, 128)),
    Param("window_block_n", (16, 32, 64, 128)),
    Param("window_warps", (4, 8)),
    Param("window_stages", (2, 3)),
    Param("span_block_m", (32, 64, 128)),
    Param("span_block_n", (16, 32, 64, 128)),
    Param("span_warps", (4, 8)),
    Param("span_stages", (2, 3)),
)
# The backward declares the same tiles (its faults with 3-stage span pipelines on the H200, an empty
# tile's NO_KEY start whose next loop step wrapped int32, are fixed: kernels/common.tile_range),
# how many parts the window dK/dV kernel splits a KV group's heads into, and the span tiles' sort.
TC_BACKWARD_SPACE = TC_SPACE + (
    Param("window_head_split", (1, 2, 4, 8, 16)),
    Param("span_sort_block", (1, 16, 64)),
)
SEARCH_SPACE = (  # the layer's stripe search: queries and heads of one KV group per program
    Param("block_q", (16, 32, 64)),
    Param("block_h", (1, 2, 4, 8, 16)),
    Param("num_warps", (4, 8)),
    Param("num_stages", (1, 2, 3)),
)
STRIPE_TILE_SPACE = (  # the layer's stripe search over tiles of stripes: one dot per tile of each query's stripes
    Param("block_s", (16, 32, 64, 128)),
    Param("block_h", (1, 2, 4, 8, 16)),
    Param("block_q", (1, 2, 4, 8, 16)),
    Param("num_warps", (1, 2, 4, 8)),
)
# --- launchers ----------------------------------------------------------------------------------


def triton_forward(geo: LaunchGeometry, config: KernelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-(query, span) Triton forward."""
    from .kernels.span_forward import span_forward  # imports Triton on first use only

    return span_forward(geo, config)


def tc_forward(geo: LaunchGeometry, config: KernelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensor-core forward: window once per query, spans in shared key tiles, LSE merge."""
    from .kernels.span_tc_forward import span_forward_tc

    return span_forward_tc(geo, config)


def reference_forward(geo: LaunchGeometry, config: KernelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch reference forward, with its log-sum-exp."""
    return span_forward_reference(
        geo.q, geo.k, geo.v, geo.qstart, geo.qend, geo.cache_position, geo.attention_mask, geo.window,
        return_lse=True,
    )


def triton_backward(geo, config, out, lse, grad_out, *, fused_spans: bool, split_dkv: bool):
    """A Triton backward variant."""
    from .kernels.span_backward import span_backward

    return span_backward(geo, config, out, lse, grad_out, fused_spans=fused_spans, split_dkv=split_dkv)


def tc_backward(geo, config, out, lse, grad_out):
    """The tensor-core backward: the window part once per query, spans in shared key tiles."""
    from .kernels.span_tc_backward import span_backward_tc

    return span_backward_tc(geo, config, out, lse, grad_out)


def reference_backward(geo, config, out, lse, grad_out):
    """The PyTorch reference backward (autograd on a recomputation)."""
    return span_backward_reference(
        geo.q, geo.k, geo.v, geo.qstart, geo.qend, geo.cache_position, geo.attention_mask, geo.window, grad_out
    )


def tiled_search(q1, k, cache_position, attention_mask, settings: SpanSettings, config: KernelConfig):
    """The layer's Triton stripe search."""
    from .layer.search_kernel import tiled_search as search

    return search(q1, k, cache_position, attention_mask, settings, config)


def stripe_tile_search(q1, k, cache_position, attention_mask, settings: SpanSettings, config: KernelConfig):
    """The layer's Triton stripe search over tiles of stripes."""
    from .layer.stripe_tile_search import stripe_tile_search as search

    return search(q1, k, cache_position, attention_mask, settings, config)


def staged_decode_with(span_forward, orchestration=staged_decode):
    """A staged-decode launcher: ``orchestration`` with its span attention run by ``span_forward``."""

    def launch(q1, q2, k, v, cache_position, attention_mask, settings: SpanSettings, config: KernelConfig):
        return orchestration(q1, q2, k, v, cache_position, attention_mask, settings, partial(span_forward, config=config))

    return launch


def position_clamped(launch):
    """``launch`` given only the last cache position, clamped at 0: an unvalidated negative position
    must never index outside the geometry tables (the grouped kernels clamp it themselves)."""

    def clamped(q1, q2, k, v, cache_position, *rest):
        return launch(q1, q2, k, v, cache_position[-1:].clamp(min=0), *rest)

    return clamped


# --- declarations -------------------------------------------------------------------------------

for spec in BUILTIN_OPS:
    REGISTRY.add_op(spec)

REGISTRY.register(Variant(
    op=SPAN_FORWARD, name="tc_tiles", launch=tc_forward, space=TC_SPACE,
    reasons=partial(tc_reasons, FORWARD_TILES, tc_forward_default),
    compile_check=partial(with_compiled, partial(tile_check, FORWARD_TILES), f"{SPAN_FORWARD}/tc_tiles"), default=tc_forward_default,
    priority=0,  # 40x to 60x faster than per_query_span at every model-M prefill and training shape on the H200
    description="tensor cores: sliding-window flash attention once per query, spans in tiles of sorted (query, span) "
    "pairs sharing key blocks, merged by log-sum-exp",
))
REGISTRY.register(Variant(
    op=SPAN_FORWARD, name="per_query_span", launch=triton_forward, space=FORWARD_SPACE, baseline=True,
    reasons=triton_reasons, compile_check=partial(resource_check, 2), default=forward_default, priority=1,
    description="one Triton program per (b, h, q, span): online softmax over the span, then the window",
))
REGISTRY.register(Variant(
    op=SPAN_FORWARD, name="reference", launch=reference_forward, space=(), reasons=always_applies,
    compile_check=no_check, default=reference_default, priority=100,
    description="PyTorch reference (masked softmax per KV group over the key blocks the spans and windows reach); "
    "CPU, float64 and fallback",
))

REGISTRY.register(Variant(
    op=SPAN_BACKWARD, name="tc_tiles", launch=tc_backward, space=TC_BACKWARD_SPACE,
    reasons=partial(tc_reasons, BACKWARD_TILES, tc_backward_default),
    compile_check=partial(with_compiled, partial(tile_check, BACKWARD_TILES), f"{SPAN_BACKWARD}/tc_tiles"), default=tc_backward_default,
    priority=0,  # 79x faster than fused_split at training 4K on the H200 (scripts/training_compare.py)
    description="tensor cores: the window part once per query (sliding-window flash backward, dK/dV in registers over "
    "parts of a KV group's heads), spans in tiles of (query, span) pairs sorted by start block and end, with one dK/dV "
    "add per tile and key block",
))
for fused in (True, False):
    for split in (True, False):
        def _reasons(problem: Problem, fused=fused, split=split) -> list[str]:
            return triton_reasons(problem) + (fused_reasons(problem) if fused else []) + (
                split_reasons(problem) if split else []
            )

        layout = "fused-span (one program per (b, h, q), window keys read once)" if fused else "per-span (one program per (b, h, q, span))"
        REGISTRY.register(Variant(
            op=SPAN_BACKWARD, name=f"{'fused' if fused else 'per_span'}_{'split' if split else 'shared'}",
            launch=partial(triton_backward, fused_spans=fused, split_dkv=split), space=BACKWARD_SPACE,
            reasons=_reasons, compile_check=partial(resource_check, 3), default=backward_default, baseline=True,
            priority=(1 if fused else 3) + (0 if split else 1),
            description=f"{layout}; dK/dV {'per query head, then a group sum' if split else 'by atomics into shared buffers'}",
        ))

REGISTRY.register(Variant(
    op=SPAN_BACKWARD, name="reference", launch=reference_backward, space=(), reasons=reference_reasons,
    compile_check=no_check, default=reference_default, priority=100,
    description="PyTorch reference (autograd on a recomputation); CPU, float64 and fallback",
))
REGISTRY.register(Variant(
    op=STAGED_DECODE, name="staged", launch=position_clamped(staged_decode_with(triton_forward)), space=FORWARD_SPACE,
    baseline=True,
    reasons=triton_reasons, compile_check=partial(resource_check, 2), default=forward_default, priority=3,
    description="stripe search and top-k in PyTorch, span attention by the per-(query, span) Triton forward",
))
REGISTRY.register(Variant(
    op=STAGED_DECODE, name="split_window", launch=position_clamped(split_window_decode), space=FORWARD_SPACE,
    baseline=True,
    reasons=triton_reasons, compile_check=partial(resource_check, 2), default=forward_default, priority=2,
    description="fused stripe search, then span/window attention in 256-key chunks merged once per head with the gate",
))
REGISTRY.register(Variant(
    op=STAGED_DECODE, name="grouped", launch=grouped_decode, space=GROUPED_SPACE, reasons=grouped_reasons,
    compile_check=grouped_check, default=grouped_default,
    priority=0,  # fastest decode variant at every context measured on the H200 (docs/benchmarks/h200-decode-compare.json)
    description="stripe search and window once per KV group, spans in tensor-core chunks, merged by the last: two launches",
))
REGISTRY.register(Variant(
    op=STAGED_DECODE, name="stripe_spans", launch=stripe_spans_decode, space=STRIPE_SPANS_SPACE,
    reasons=stripe_spans_reasons, compile_check=stripe_spans_check, default=stripe_spans_default,
    priority=1,  # short contexts only: the tuner chooses it where it wins
    description="stripe search, window and the span of every stripe once per KV group in one launch (no span work "
    "waits for the search), then a merge that picks each head's chosen spans: two launches",
))
REGISTRY.register(Variant(
    op=STAGED_DECODE, name="group_spans", launch=group_spans_decode, space=GROUP_SPANS_SPACE,
    reasons=group_spans_reasons, compile_check=group_spans_check, default=group_spans_default,
    # After every other kernel decode: 1.65x to 1.8x slower than grouped on an H100 (docs/device-runs/
    # h100-session33.txt, h100-session35.txt); the tuner still chooses it where it wins.
    priority=4,
    description="stripe search and window once per KV group, then per chunk of key positions every chosen span of "
    "the group's heads, each key read once for all of them: two launches",
))
REGISTRY.register(Variant(
    op=STAGED_DECODE, name="staged_reference", launch=position_clamped(staged_decode_with(reference_forward)), space=(),
    reasons=always_applies, compile_check=no_check, default=reference_default, priority=100,
    description="stripe search and top-k in PyTorch, span attention by the PyTorch reference",
))
REGISTRY.register(Variant(
    op=ATTENTION_LAYER, name="tiled_search", launch=tiled_search, space=SEARCH_SPACE, reasons=search_reasons,
    compile_check=search_check, default=search_default, priority=1,
    description="Triton stripe search: per stripe, one gathered key row per query scored against several heads' "
    "rows by one tensor-core dot (its diagonal); top-k in registers; spans and window by the span ops' dispatch",
))
REGISTRY.register(Variant(
    op=ATTENTION_LAYER, name="stripe_tiles", launch=stripe_tile_search, space=STRIPE_TILE_SPACE, reasons=search_reasons,
    compile_check=stripe_tile_check, default=stripe_tile_default,
    priority=0,  # 4.2x (8192 over 139,264) to 4.8x (32,768 over 1M) faster than tiled_search on the H200 at model M
    description="Triton stripe search over tiles of stripes: each query's heads scored against a tile of its stripe "
    "keys by one tensor-core dot (no product wasted at 16 heads per KV group); top-k in registers",
))
REGISTRY.register(Variant(
    op=ATTENTION_LAYER, name="reference", launch=search_reference, space=(), reasons=always_applies,
    compile_check=no_check, default=reference_default, priority=100,
    description="PyTorch stripe search (scores gathered in query chunks, stable sort for the ties); CPU, float64 "
    "and fallback",
))


# --- the layer's gate ---------------------------------------------------------------------------

GATE_SPACE = (Param("block_r", (8, 16, 32, 64)), Param("num_warps", (1, 2, 4, 8)))  # (b, h, q) rows per program
# Per gate op: its launchers (Triton, PyTorch) and the fp32 [block_r, D] tiles one program holds at once.
GATE_STEPS = {
    GATE_SCORES: (gate_paths.triton_gate_scores, gate_paths.torch_gate_scores, 2),  # Q1, key rows
    GATE_SCORES_BACKWARD: (gate_paths.triton_gate_scores_backward, gate_paths.torch_gate_scores_backward, 3),  # + dQ1
    GATE: (gate_paths.triton_gate, gate_paths.torch_gate, 2),  # accumulator, span output
    GATE_BACKWARD: (gate_paths.triton_gate_backward, gate_paths.torch_gate_backward, 3),  # dOut, span output, dO_j
}


for _op, (_triton, _torch, _tiles) in GATE_STEPS.items():
    REGISTRY.register(Variant(
        op=_op, name="row_blocks", launch=_triton, space=GATE_SPACE, reasons=triton_reasons,
        compile_check=partial(rows_check, _tiles), default=gate_default, priority=0,
        description="Triton: block_r (b, h, q) rows per program, every slot of a row in registers, fp32",
    ))
    REGISTRY.register(Variant(
        op=_op, name="reference", launch=_torch, space=(), reasons=always_applies, compile_check=no_check,
        default=reference_default, priority=100, description="PyTorch (gathers and reductions); CPU, float64 and fallback",
    ))
