"""The span forward's and span backward's variants, one block each: its space, when it applies, its
static checks, its default, its kernels compiled ahead of time, and its registration.

Launch signatures: span_forward ``launch(geo, config) -> (out [B, Hq, Lq, K, D], lse2 [B, Hq, Lq, K])``;
span_backward ``launch(geo, config, out, lse2, grad_out) -> (dQ, dK, dV)``.
"""

from __future__ import annotations

from functools import partial

import torch

from ...arch_check import compiled_part_reason, with_compiled
from ...buckets import next_power_of_two
from ...launch import KernelConfig, LaunchGeometry
from ...problem import SPAN_BACKWARD, SPAN_FORWARD, Problem
from ...registry import KernelSpec, Param, Variant
from ..rules import (
    FORWARD_SPACE,
    MAX_TC_VALUES_PER_THREAD,
    WARPS,
    always_applies,
    element_bytes,
    forward_default,
    misfit,
    no_check,
    reference_default,
    reference_reasons,
    resource_check,
    shared_limit,
    shared_reason,
    triton_reasons,
)
from .reference import span_backward_reference, span_forward_reference

# --- the tensor-core tiles both tc_tiles variants share ---------------------------------------

TC_SPACE = (  # the window kernels' tiles, then the span-tile kernel's
    Param("window_block_m", (32, 64, 128)),
    Param("window_block_n", (16, 32, 64, 128)),
    Param("window_warps", (4, 8)),
    Param("window_stages", (2, 3)),
    Param("span_block_m", (32, 64, 128)),
    Param("span_block_n", (16, 32, 64, 128)),
    Param("span_warps", (4, 8)),
    Param("span_stages", (2, 3)),
)
# Per tensor-core kernel part: (fp32 register values, shared-memory elements) of one program as a
# function of its tile sizes m (BLOCK_M), n (BLOCK_N), d (padded D) and pipeline stages s.
FORWARD_TILES = {
    "window": lambda m, n, d, s: (m * d + m * n, (s * 2 * n + m) * d),  # acc [m, d], scores [m, n]; K/V stages + Q
    "span": lambda m, n, d, s: (m * d + m * n, (s * 2 * n + m) * d),
}
BACKWARD_TILES = {
    "window": lambda m, n, d, s: (2 * n * d + n * m, (s * 2 * m + 2 * n) * d),  # dK, dV [n, d]; Q/dO stages + K/V
    "span": lambda m, n, d, s: (m * d + 2 * n * d + m * n, (s * 2 * n + 2 * m) * d),  # dQ [m, d], dK/dV block
}
K_SPANS = 3  # span slots the kernels are compiled ahead of time for (model M's topk)


def tile_check(tiles: dict, problem: Problem, config: KernelConfig) -> str | None:
    """Why a tensor-core configuration cannot build or run well (GPU only): each kernel part's
    accumulators and scores per thread, and its pipelined tiles in shared memory (``tiles``)."""
    if not problem.device.is_gpu:
        return None
    block_d = next_power_of_two(problem.head_dim)
    limit = shared_limit(problem)
    for part, estimate in tiles.items():
        m, n, warps, stages = (config[f"{part}_{name}"] for name in ("block_m", "block_n", "warps", "stages"))
        values, elements = estimate(m, n, block_d, stages)
        if values / (32 * warps) > MAX_TC_VALUES_PER_THREAD:
            return f"{part} registers: about {values / (32 * warps):.0f} fp32 values per thread for {m}/{n} tiles on {warps} warps"
        if elements * element_bytes(problem) > limit:
            return f"{part} shared memory: about {elements * element_bytes(problem)} bytes for {stages} stages of {m}/{n} tiles > {limit}"
    return None


def tc_reasons(tiles: dict, default, problem: Problem) -> list[str]:
    """Why a tensor-core variant cannot serve ``problem``: the Triton rules, or no tiling that fits."""
    return triton_reasons(problem) or misfit(problem, default, lambda p, config: tile_check(tiles, p, config))


def fitted(config: KernelConfig, tiles: dict, problem: Problem, variant: str = "") -> KernelConfig:
    """``config`` with each tensor-core kernel part shrunk (fewer stages, then narrower key tiles,
    then fewer rows) until ``tile_check`` and the compiled table for ``variant`` on the GPU's arch accept it."""
    for part in tiles:
        while tile_check({part: tiles[part]}, problem, config) is not None or compiled_part_reason(variant, part, problem, config):
            for name, floor in (("stages", 2), ("block_n", 32), ("block_m", 64)):
                if config[f"{part}_{name}"] > floor:
                    value = config[f"{part}_{name}"]
                    config = config.replace(**{f"{part}_{name}": 2 if name == "stages" else value // 2})
                    break
            else:
                return config  # nothing smaller to try: the tuner's compile check will say why
    return config


def _attention_tiles(m: int, n: int, d: int) -> dict:
    return dict(D_HEAD=d, BLOCK_D=d, BLOCK_M=m, BLOCK_N=n, HAS_MASK=False, UPCAST=False)


def _pointer_tiles(m: int, n: int, d: int) -> dict:  # kernels with a TMA path, compiled without it
    return dict(_attention_tiles(m, n, d), KV_TMA=False)


def _forward_tiles(m: int, n: int, d: int) -> dict:  # the forward's kernels over every tile (no mask)
    return dict(_pointer_tiles(m, n, d), TILES=0)


# --- span_forward/tc_tiles ----------------------------------------------------------------------

TC_FORWARD_DEFAULTS: dict[str, int] = {  # sm_90, bf16, D = 128: the best of a model-M sweep
    "window_block_m": 128, "window_block_n": 64, "window_warps": 8, "window_stages": 3,
    "span_block_m": 64, "span_block_n": 64, "span_warps": 4, "span_stages": 3,
}


def tc_forward_default(problem: Problem) -> KernelConfig:
    """Heuristic tensor-core forward configuration: ``TC_FORWARD_DEFAULTS`` for 16-bit inputs and
    D <= 128, smaller tiles for wider rows or fp32, then shrunk until they fit the GPU (``fitted``)."""
    tiles = dict(TC_FORWARD_DEFAULTS)
    if problem.head_dim > 128 or problem.dtype == "float32":
        block_n = 16 if problem.head_dim > 128 and problem.dtype == "float32" else 32
        for part in ("window", "span"):
            tiles.update({f"{part}_block_m": 64, f"{part}_block_n": block_n, f"{part}_warps": 4, f"{part}_stages": 2})
    return fitted(KernelConfig(tiles), FORWARD_TILES, problem, f"{SPAN_FORWARD}/tc_tiles")


def tc_forward(geo: LaunchGeometry, config: KernelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensor-core forward: window once per query, spans in shared key tiles, LSE merge."""
    from .tile_forward import span_forward_tc

    return span_forward_tc(geo, config)


TC_FORWARD = Variant(
    op=SPAN_FORWARD, name="tc_tiles", launch=tc_forward, space=TC_SPACE,
    reasons=partial(tc_reasons, FORWARD_TILES, tc_forward_default),
    compile_check=partial(with_compiled, partial(tile_check, FORWARD_TILES), f"{SPAN_FORWARD}/tc_tiles"),
    default=tc_forward_default, priority=0,  # the fastest at every prefill and training shape measured
    description="tensor cores: sliding-window flash attention once per query, spans in tiles of sorted (query, span) "
    "pairs sharing key blocks, merged by log-sum-exp",
    compiled_parts={
        "window": (KernelSpec(f"{__package__}.window_forward", "window_attention_kernel", _forward_tiles),),
        "span": (KernelSpec(f"{__package__}.tile_forward", "span_tile_kernel",
                            lambda m, n, d: dict(_forward_tiles(m, n, d), K_SPANS=K_SPANS, HAS_WINDOW=True, EDGE_TMA=False)),),
    },
)

# --- span_forward/hopper_tiles ------------------------------------------------------------------

HOPPER_SPACE = tuple(  # each Gluon kernel's key block, K/V buffers, and turns of its two consumers' matrix work
    Param(f"{part}_{name}", values) for part in ("window", "span")
    for name, values in (("block_n", (64, 128)), ("stages", (2, 3, 4)), ("mma_turns", (1, 2)))
)
HOPPER_DEFAULTS: dict[str, int] = {  # sm_90, bf16, D = 128: the fastest at 1M keys (H100)
    f"{part}_{name}": value for part in ("window", "span") for name, value in (("block_n", 128), ("stages", 3), ("mma_turns", 2))
}
HOPPER_SHARED_SLACK = 1024  # bytes beside the tiles: mbarriers, partition state (sm_90 compiles: 304 to 416)


def hopper_check(problem: Problem, config: KernelConfig) -> str | None:
    """Why a hopper_tiles configuration cannot run (GPU only): a kernel's 128 query rows and K/V
    buffers past the shared memory."""
    if not problem.device.is_gpu:
        return None
    from .hopper_tile_forward import TILE_ROWS

    for part in ("window", "span"):
        n, stages = config[f"{part}_block_n"], config[f"{part}_stages"]
        shared = (TILE_ROWS + 2 * stages * n) * next_power_of_two(problem.head_dim) * element_bytes(problem) + HOPPER_SHARED_SLACK
        reason = shared_reason(shared, f"the {part} kernel's {TILE_ROWS} query rows and {stages} stages of {n}-key K/V blocks", problem)
        if reason is not None:
            return reason
    return None


def hopper_default(problem: Problem) -> KernelConfig:
    """Heuristic hopper_tiles configuration: ``HOPPER_DEFAULTS``, fewer stages until it fits."""
    config = KernelConfig(HOPPER_DEFAULTS)
    for part in ("window", "span"):
        while hopper_check(problem, config) is not None and config[f"{part}_stages"] > 2:
            config = config.replace(**{f"{part}_stages": config[f"{part}_stages"] - 1})
    return config


def hopper_reasons(problem: Problem) -> list[str]:
    """Why the Gluon kernels cannot serve ``problem``: they need an sm_90 GPU, 16-bit inputs, a head
    dim of 64 or 128 and no attention mask (every key of a tile's range reaches its dots)."""
    reasons = []
    if problem.device.arch != "sm_90":
        reasons.append(f"needs an sm_90 GPU (Gluon warp specialisation and wgmma; Triton's interpreter does not run "
                       f"it), not {problem.device.arch}")
    if problem.dtype not in ("bfloat16", "float16"):
        reasons.append(f"{problem.dtype} inputs: the wgmma tiles take bfloat16 or float16")
    if problem.head_dim not in (64, 128):
        reasons.append(f"head dim {problem.head_dim}: the TMA blocks take 64 or 128")
    if problem.masked:
        reasons.append("an attention mask: tc_tiles serves masked problems")
    return reasons or misfit(problem, hopper_default, hopper_check)


def hopper_forward(geo: LaunchGeometry, config: KernelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward in Gluon, FlashAttention-3 style: window once per query and spans in tiles, each
    by a TMA producer warp and consumer warpgroups on wgmma, LSE merge; K and V that TMA cannot read
    (rows not one evenly spaced, 16-byte aligned run) take tc_tiles with its sm_90 defaults."""
    from .hopper_tile_forward import span_forward_hopper, tma_readable
    from .tile_forward import span_forward_tc

    return span_forward_hopper(geo, config) if tma_readable(geo) else span_forward_tc(geo, TC_FORWARD_DEFAULTS)


HOPPER_FORWARD = Variant(
    op=SPAN_FORWARD, name="hopper_tiles", launch=hopper_forward, space=HOPPER_SPACE, reasons=hopper_reasons,
    compile_check=hopper_check, default=hopper_default, priority=2,  # the tuner chooses it where it wins
    description="tc_tiles' plan with the window and span tiles in Gluon for sm_90: a TMA producer warp feeding K/V "
    "buffers to two consumer warpgroups on wgmma, each computing a block's scores while the last block's values are "
    "summed, their matrix work in turns or not",
)

# --- span_forward/per_query_span (baseline) -----------------------------------------------------


def triton_forward(geo: LaunchGeometry, config: KernelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-(query, span) Triton forward."""
    from .per_query_forward import span_forward  # imports Triton on first use only

    return span_forward(geo, config)


PER_QUERY_SPAN = Variant(
    op=SPAN_FORWARD, name="per_query_span", launch=triton_forward, space=FORWARD_SPACE, baseline=True,
    reasons=triton_reasons, compile_check=partial(resource_check, 2), default=forward_default, priority=1,
    description="one Triton program per (b, h, q, span): online softmax over the span, then the window",
)

# --- span_forward/reference ---------------------------------------------------------------------


def reference_forward(geo: LaunchGeometry, config: KernelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch reference forward, with its log-sum-exp."""
    return span_forward_reference(
        geo.q, geo.k, geo.v, geo.qstart, geo.qend, geo.cache_position, geo.attention_mask, geo.window,
        return_lse=True,
    )


FORWARD_REFERENCE = Variant(
    op=SPAN_FORWARD, name="reference", launch=reference_forward, space=(), reasons=always_applies,
    compile_check=no_check, default=reference_default, priority=100,
    description="PyTorch reference (masked softmax per KV group over the key blocks the spans and windows reach); "
    "CPU, float64 and fallback",
)

# --- span_backward/tc_tiles ---------------------------------------------------------------------

# The backward declares the forward's tiles, how many parts the window dK/dV kernel splits a KV
# group's heads into, and the span tiles' sort block.
TC_BACKWARD_SPACE = TC_SPACE + (
    Param("window_head_split", (1, 2, 4, 8, 16)),
    Param("span_sort_block", (1, 16, 64)),
)
TC_BACKWARD_DEFAULTS: dict[str, int] = {  # sm_90, bf16, D = 128: the best of model-M sweeps at 4K to 64K
    "window_block_m": 64,  # queries per tile of the dK/dV kernel (keys per block of the dQ kernel)
    "window_block_n": 64,  # keys per block of the dK/dV kernel (queries per tile of the dQ kernel)
    "window_warps": 4,
    "window_stages": 2,
    "span_block_m": 128,  # sorted (head, query, span) triples per tile
    "span_block_n": 64,  # keys per block
    "span_warps": 8,
    "span_stages": 2,
    "window_head_split": 8,  # parts of a KV group's heads in the dK/dV kernel (more programs; atomics if > 1)
    "span_sort_block": 64,  # span tiles sort by (start // 64, end)
}


def tc_backward_default(problem: Problem) -> KernelConfig:
    """Heuristic tensor-core backward configuration: ``TC_BACKWARD_DEFAULTS``, shrunk until they fit (``fitted``)."""
    return fitted(KernelConfig(TC_BACKWARD_DEFAULTS), BACKWARD_TILES, problem, f"{SPAN_BACKWARD}/tc_tiles")


def tc_backward(geo, config, out, lse, grad_out):
    """The tensor-core backward: the window part once per query, spans in shared key tiles."""
    from .tile_backward import span_backward_tc

    return span_backward_tc(geo, config, out, lse, grad_out)


TC_BACKWARD = Variant(
    op=SPAN_BACKWARD, name="tc_tiles", launch=tc_backward, space=TC_BACKWARD_SPACE,
    reasons=partial(tc_reasons, BACKWARD_TILES, tc_backward_default),
    compile_check=partial(with_compiled, partial(tile_check, BACKWARD_TILES), f"{SPAN_BACKWARD}/tc_tiles"),
    default=tc_backward_default, priority=0,  # the fastest at every training shape measured
    description="tensor cores: the window part once per query (sliding-window flash backward, dK/dV in registers over "
    "parts of a KV group's heads), spans in tiles of (query, span) pairs sorted by start block and end, with one dK/dV "
    "add per tile and key block",
    compiled_parts={
        "window": (
            KernelSpec(f"{__package__}.window_backward", "window_dkdv_kernel",
                       lambda m, n, d: dict(_attention_tiles(m, n, d), ATOMIC_ADD=False, ROWS_TMA=False)),
            # the dQ kernel's tiles are the dK/dV kernel's, transposed
            KernelSpec(f"{__package__}.window_backward", "window_dq_kernel", lambda m, n, d: _pointer_tiles(n, m, d)),
        ),
        "span": (KernelSpec(f"{__package__}.tile_backward", "span_tile_backward_kernel",
                            lambda m, n, d: dict(_attention_tiles(m, n, d), K_SPANS=K_SPANS)),),
    },
)

# --- span_backward/{fused,per_span}_{split,shared} (baselines) ----------------------------------

BACKWARD_SPACE = (Param("block_k", (16, 32, 64, 128)), WARPS, Param("num_stages", (1, 2, 3)))
SPLIT_DKV_BUDGET_BYTES = 16 << 30


def fused_reasons(problem: Problem) -> list[str]:
    """Why the fused-span backward does not apply."""
    return ["K = 1 span slot: fused-span is the per-span kernel"] if problem.spans == 1 else []


def split_reasons(problem: Problem) -> list[str]:
    """Why split dK/dV does not apply."""
    if problem.rep == 1:
        return ["rep = 1 (MHA): split dK/dV buffers are the shared ones"]
    need = 2 * problem.batch * problem.q_heads * problem.keys * problem.head_dim * 4
    if need > SPLIT_DKV_BUDGET_BYTES:
        return [f"split dK/dV buffers need {need / 2**30:.1f} GiB > {SPLIT_DKV_BUDGET_BYTES >> 30} GiB"]
    return []


def backward_default(problem: Problem) -> KernelConfig:
    """Heuristic per-query backward configuration: 32-key blocks, 4 warps, 1 stage."""
    return KernelConfig(block_k=32, num_warps=4, num_stages=1)


def triton_backward(geo, config, out, lse, grad_out, *, fused_spans: bool, split_dkv: bool):
    """A Triton backward variant."""
    from .per_query_backward import span_backward

    return span_backward(geo, config, out, lse, grad_out, fused_spans=fused_spans, split_dkv=split_dkv)


def per_query_backward(fused: bool, split: bool) -> Variant:
    """The per-query backward with the fused-span (one program per (b, h, q)) or per-span layout and
    split (per query head, then a group sum) or shared (atomics) dK/dV."""

    def reasons(problem: Problem) -> list[str]:
        return triton_reasons(problem) + (fused_reasons(problem) if fused else []) + (split_reasons(problem) if split else [])

    layout = "fused-span (one program per (b, h, q), window keys read once)" if fused else "per-span (one program per (b, h, q, span))"
    return Variant(
        op=SPAN_BACKWARD, name=f"{'fused' if fused else 'per_span'}_{'split' if split else 'shared'}",
        launch=partial(triton_backward, fused_spans=fused, split_dkv=split), space=BACKWARD_SPACE,
        reasons=reasons, compile_check=partial(resource_check, 3), default=backward_default, baseline=True,
        priority=(1 if fused else 3) + (0 if split else 1),
        description=f"{layout}; dK/dV {'per query head, then a group sum' if split else 'by atomics into shared buffers'}",
    )


# --- span_backward/reference --------------------------------------------------------------------


def reference_backward(geo, config, out, lse, grad_out):
    """The PyTorch reference backward (autograd on a recomputation)."""
    return span_backward_reference(
        geo.q, geo.k, geo.v, geo.qstart, geo.qend, geo.cache_position, geo.attention_mask, geo.window, grad_out
    )


BACKWARD_REFERENCE = Variant(
    op=SPAN_BACKWARD, name="reference", launch=reference_backward, space=(), reasons=reference_reasons,
    compile_check=no_check, default=reference_default, priority=100,
    description="PyTorch reference (autograd on a recomputation); CPU, float64 and fallback",
)

VARIANTS: tuple[Variant, ...] = (
    TC_FORWARD, HOPPER_FORWARD, PER_QUERY_SPAN, FORWARD_REFERENCE, TC_BACKWARD,
    *(per_query_backward(fused, split) for fused in (True, False) for split in (True, False)), BACKWARD_REFERENCE,
)
