"""When each variant applies, its static configuration checks and its heuristic defaults: the rules
``variants.py`` declares its variants with. They read only what a problem's key holds (bucketed
sizes: the dispatcher hands them the key's problem), so every problem of one bucket gets the same
answer. None of this is launched, so none of it enters a variant's code hash.
"""

from __future__ import annotations

from . import geometry
from .arch_check import compiled_part_reason
from .buckets import next_power_of_two
from .decode.grouped_plan import MAX_SPAN_ROWS, MIN_DOT, WINDOW_CHUNK, span_chunk_length, span_rows
from .kernels.launch import KernelConfig
from .ops.spec import span_length  # no decode span at the problem's key length is longer
from .problem import SPAN_BACKWARD, SPAN_FORWARD, Problem

MAX_VALUES_PER_THREAD = 256  # fp32 tile values per thread above which kernels spill
SPLIT_DKV_BUDGET_BYTES = 16 << 30
REFERENCE_SCORE_BUDGET = 1 << 31  # scores the backward reference may materialise
SHARED_MEMORY_BYTES = {  # per thread block, by compute capability
    "sm_90": 232448, "sm_100": 232448, "sm_120": 101376, "sm_80": 166912, "sm_87": 166912,
    "sm_86": 101376, "sm_89": 101376, "sm_75": 65536, "sm_70": 98304,
}
DEFAULT_SHARED_MEMORY_BYTES = 49152


MAX_TC_VALUES_PER_THREAD = 160  # fp32 accumulator + score values per thread of a tensor-core tile
DECODE_SHARED_SLACK = 1024  # bytes beside a decode program's tiles (barriers, reductions: 24 to 312 in sm_90 compiles)


# --- when Triton variants apply ---------------------------------------------------------------


def triton_reasons(problem: Problem) -> list[str]:
    """Why the Triton kernels cannot serve ``problem`` (empty when they can)."""
    reasons = []
    if not problem.device.is_gpu and not problem.device.interpreter:
        reasons.append("CPU tensors without TRITON_INTERPRET=1 run the PyTorch reference")
    if problem.dtype == "float64":
        reasons.append("float64 inputs: the Triton kernels accumulate in fp32; float64 runs the reference")
    if problem.head_dim > 256:
        reasons.append(f"head dim {problem.head_dim} > 256")
    return reasons


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


def grouped_reasons(problem: Problem) -> list[str]:
    """Why the grouped decode kernels cannot serve ``problem`` (``_misfit``: not even the smallest
    tiles fit its GPU)."""
    reasons = triton_reasons(problem)
    if problem.rep > 64:
        reasons.append(f"rep = {problem.rep} > 64 query heads per KV head (one program holds a whole group)")
    return reasons or _misfit(problem, grouped_default, grouped_check)


def _misfit(problem: Problem, default, check) -> list[str]:
    """Why no configuration fits the GPU, when even ``default`` (the heuristic falls back to the
    smallest tiles) fails ``check``; else none."""
    reason = check(problem, default(problem))
    return [] if reason is None else [f"even the smallest tiles do not fit: {reason}"]


# Keys per KV group in every stripe's span above which stripe_spans does not apply (model M on the
# H200: at 4K, 12K keys, 1.2x faster than grouped; at 64K, 678K keys, 3x slower), and its partials' budget.
STRIPE_SPANS_KEYS = 1 << 19
STRIPE_SPANS_BYTES = 1 << 28


def _stripes_and_longest_span(problem: Problem) -> tuple[int, int]:
    """(stripes of the key length's table, keys of its longest span): what stripe_spans attends per group."""
    stripes = geometry.stripe_count(problem.keys, problem.sw_index, problem.params) - problem.sw_index  # i > sw_index
    return stripes, min(span_length(problem.factors, problem.keys), problem.keys)


def stripe_spans_reasons(problem: Problem) -> list[str]:
    """Why the stripe_spans decode kernels cannot serve ``problem``: the grouped rules, or spans of
    every stripe so long that attending them all cannot pay."""
    reasons = grouped_reasons(problem)
    stripes, longest = _stripes_and_longest_span(problem)
    if stripes * longest > STRIPE_SPANS_KEYS:
        reasons.append(f"every stripe's span is {stripes} x {longest} keys per KV group > {STRIPE_SPANS_KEYS}: "
                       "attending them all beside the search costs more than waiting for it")
    return reasons or _misfit(problem, stripe_spans_default, stripe_spans_check)


def stripe_spans_check(problem: Problem, config: KernelConfig) -> str | None:
    """Why a stripe_spans configuration cannot build or run well: the grouped resource rules, or span
    partials (one per head, stripe and chunk) above ``STRIPE_SPANS_BYTES``."""
    stripes, longest = _stripes_and_longest_span(problem)
    chunks = -(-longest // config.chunk)
    partials = problem.batch * problem.q_heads * stripes * chunks * (problem.head_dim + 2) * 4
    if partials > STRIPE_SPANS_BYTES:
        return (f"span partials: {partials / 2**20:.0f} MiB for {stripes} stripes x {chunks} chunks of {config.chunk} "
                f"keys > {STRIPE_SPANS_BYTES >> 20} MiB (take longer chunks)")
    # Without a mask its window programs take WINDOW_CHUNK-key blocks by pointer loads, in the same stages.
    return grouped_check(problem, config, config.block_k if problem.masked else max(config.block_k, WINDOW_CHUNK))


def group_spans_reasons(problem: Problem) -> list[str]:
    """Why the group_spans decode kernels cannot serve ``problem``: the grouped rules, or more
    (head, slot) rows per KV group than one program holds."""
    reasons = grouped_reasons(problem)
    if span_rows(problem.rep, problem.spans) > MAX_SPAN_ROWS:
        reasons.append(f"rep {problem.rep} x topk {problem.spans} span rows per KV group > {MAX_SPAN_ROWS} "
                       "(one program holds every (head, slot) row of a group)")
    return reasons or _misfit(problem, group_spans_default, group_spans_check)


def group_spans_check(problem: Problem, config: KernelConfig) -> str | None:
    """Why a group_spans configuration cannot build or run well (GPU only): the grouped resource
    register rule, its (head, slot) rows' accumulator and scores past the registers of its warps, or
    its tiles past the shared memory (num_stages K/V buffers: no stage is saved as in grouped's loop)."""
    if not problem.device.is_gpu:
        return None
    rows = span_rows(problem.rep, problem.spans)
    per_thread = rows * (next_power_of_two(problem.head_dim) + config.block_k) / (32 * config.num_warps)
    if per_thread > MAX_VALUES_PER_THREAD:
        return (f"registers: about {per_thread:.0f} fp32 values per thread for {rows} span rows' accumulator and "
                f"scores ({config.block_k}-key blocks) on {config.num_warps} warps (limit {MAX_VALUES_PER_THREAD})")
    return register_reason(2, problem, config) or decode_shared_reason(
        problem, config.block_k, config.num_stages, rows, f"{config.num_stages} stages of K/V tiles and {rows} span rows")


def tc_reasons(tiles: dict, default, problem: Problem) -> list[str]:
    """Why a tensor-core variant cannot serve ``problem``: the Triton rules, or no tiling that fits."""
    return triton_reasons(problem) or _misfit(problem, default, lambda p, config: tile_check(tiles, p, config))


def always_applies(problem: Problem) -> list[str]:
    """No reasons: the variant serves every problem (the layer's search reference works in query
    chunks, the span forward reference in key blocks)."""
    return []


def reference_reasons(problem: Problem) -> list[str]:
    """Why the dense PyTorch backward reference is unfit (it materialises every score)."""
    scores = problem.batch * problem.q_heads * problem.queries * problem.spans * problem.keys
    if scores > REFERENCE_SCORE_BUDGET:
        return [f"the reference would materialise {scores:.3g} scores (> {REFERENCE_SCORE_BUDGET:.3g})"]
    return []


def search_reasons(problem: Problem) -> list[str]:
    """Why the Triton layer search cannot serve ``problem``."""
    reasons = triton_reasons(problem)
    if problem.spans > 64:
        reasons.append(f"topk = {problem.spans} > 64 kept scores per query")
    return reasons


# --- static configuration checks --------------------------------------------------------------


def resource_check(tiles: int, problem: Problem, config: KernelConfig) -> str | None:
    """Why ``config`` cannot build or run well: register or shared-memory estimate (GPU only)."""
    if not problem.device.is_gpu:
        return None
    block_d = next_power_of_two(problem.head_dim)
    return register_reason(tiles, problem, config) or _shared_reason(
        max(config.num_stages - 1, 1) * 2 * config.block_k * block_d * _element(problem),
        f"{config.num_stages} stages of K/V tiles", problem)


def register_reason(tiles: int, problem: Problem, config: KernelConfig) -> str | None:
    """Why ``tiles`` [block_k x D] fp32 tiles spill on the config's warps, if they do (GPU only)."""
    block_d = next_power_of_two(problem.head_dim)
    per_thread = tiles * config.block_k * block_d / (32 * config.num_warps)
    if problem.device.is_gpu and per_thread > MAX_VALUES_PER_THREAD:
        return (
            f"registers: about {per_thread:.0f} fp32 values per thread for {tiles} [{config.block_k} x {block_d}] "
            f"tiles on {config.num_warps} warps (limit {MAX_VALUES_PER_THREAD})"
        )
    return None


def decode_shared_reason(problem: Problem, block_k: int, buffers: int, rows: int, what: str) -> str | None:
    """Why a tensor-core decode program does not fit the GPU's shared memory (GPU only): ``buffers``
    [block_k, D] K and V tiles, its [rows, D] queries and [rows, block_k] weights staged for the dots,
    and ``DECODE_SHARED_SLACK``. Against sm_90 compiles of model M's grouped, stripe_spans and
    group_spans kernels (every block_k and num_stages, bf16, masked or not) it refuses exactly those
    compiled past the limit. Far from it the estimate can be off either way: one-stage loops compile
    smaller, group_spans' smallest tiles compile to a 48 KB floor."""
    block_d = next_power_of_two(problem.head_dim)
    shared = (buffers * 2 * block_k * block_d + rows * (block_d + block_k)) * _element(problem) + DECODE_SHARED_SLACK
    return _shared_reason(shared, what, problem) if problem.device.is_gpu else None


def _element(problem: Problem) -> int:
    return 4 if problem.dtype == "float32" else 2


def _shared_reason(shared: int, what: str, problem: Problem) -> str | None:
    limit = SHARED_MEMORY_BYTES.get(problem.device.arch, DEFAULT_SHARED_MEMORY_BYTES)
    if shared > limit:
        return f"shared memory: about {shared} bytes for {what} > {limit} on {problem.device.arch}"
    return None


def grouped_check(problem: Problem, config: KernelConfig, block_k: int | None = None) -> str | None:
    """Why a grouped configuration cannot build or run well (GPU only): two [block_k x D] fp32 tiles
    past the registers of its warps, or its span program's pipelined K/V tiles (num_stages - 1
    buffers, Triton's pipelining) and its head rows past the shared memory (``block_k``: the key
    block, when a part of the kernel takes wider ones than the config's)."""
    rows = max(next_power_of_two(problem.rep), MIN_DOT)
    return register_reason(2, problem, config) or decode_shared_reason(
        problem, block_k or config.block_k, max(config.num_stages - 1, 1), rows, f"{config.num_stages} stages of K/V tiles")


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


def tile_check(tiles: dict, problem: Problem, config: KernelConfig) -> str | None:
    """Why a tensor-core configuration cannot build or run well (GPU only): each kernel part's
    accumulators and scores per thread, and its pipelined tiles in shared memory (``tiles``)."""
    if not problem.device.is_gpu:
        return None
    block_d = next_power_of_two(problem.head_dim)
    element = 4 if problem.dtype == "float32" else 2
    limit = SHARED_MEMORY_BYTES.get(problem.device.arch, DEFAULT_SHARED_MEMORY_BYTES)
    for part, estimate in tiles.items():
        m, n, warps, stages = (config[f"{part}_{name}"] for name in ("block_m", "block_n", "warps", "stages"))
        values, elements = estimate(m, n, block_d, stages)
        if values / (32 * warps) > MAX_TC_VALUES_PER_THREAD:
            return f"{part} registers: about {values / (32 * warps):.0f} fp32 values per thread for {m}/{n} tiles on {warps} warps"
        if elements * element > limit:
            return f"{part} shared memory: about {elements * element} bytes for {stages} stages of {m}/{n} tiles > {limit}"
    return None


def _search_reason(problem: Problem, config: KernelConfig, rows: int, cols: int, key_rows: int) -> str | None:
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


def search_check(problem: Problem, config: KernelConfig) -> str | None:
    """Why a ``tiled_search`` configuration cannot run well (``_search_reason``: its rows are
    block_h x block_q (head, query) pairs, scored against the block's block_q keys)."""
    return _search_reason(problem, config, config.block_h * config.block_q, config.block_q, 0)


def stripe_tile_check(problem: Problem, config: KernelConfig) -> str | None:
    """Why a stripe-tile search configuration cannot run well: dots under 16 rows or columns, more
    queries than needed at 16 heads, or ``_search_reason`` (its block_q x block_s columns are the
    prefetched stripe keys)."""
    rows, cols = config.block_q * config.block_h, config.block_q * config.block_s
    if rows < 16 or cols < 16:
        return f"block_q * block_h = {rows} rows and block_q * block_s = {cols} columns: a tensor-core dot needs 16 of each"
    if config.block_q > 1 and config.block_h >= 16:
        return f"block_q {config.block_q} with block_h {config.block_h}: 16 heads already fill the dot's rows"
    return _search_reason(problem, config, rows, cols, cols)


def no_check(problem: Problem, config: KernelConfig) -> str | None:
    """The reference has nothing to compile."""
    return None


def forward_default(problem: Problem) -> KernelConfig:
    """Heuristic forward configuration: 64-key blocks (32 past D = 128), 4 warps, 2 stages."""
    return KernelConfig(block_k=64 if problem.head_dim <= 128 else 32, num_warps=4, num_stages=2)


def backward_default(problem: Problem) -> KernelConfig:
    """Heuristic backward configuration: 32-key blocks, 4 warps, 1 stage."""
    return KernelConfig(block_k=32, num_warps=4, num_stages=1)


def grouped_default(problem: Problem) -> KernelConfig:
    """Heuristic grouped-decode configuration: 64-key tiles (32 past D = 128), 4 warps, the most
    stages up to 3 that fit (64/4/3 was within 4% of the best at every model-M context in the H200
    sweep, docs/benchmarks/h200-decode-sweep.json) and span chunks that give about four programs
    per multiprocessor."""
    spans = problem.batch * problem.q_heads * problem.spans
    return _decode_default(problem, span_length(problem.factors, problem.keys), spans, grouped_check)


def stripe_spans_default(problem: Problem) -> KernelConfig:
    """Heuristic stripe_spans configuration: the grouped tiles, with chunks of every stripe's span
    that give about four programs per multiprocessor, made longer until the partials fit."""
    stripes, longest = _stripes_and_longest_span(problem)
    return _decode_default(problem, longest, problem.batch * problem.kv_heads * stripes, stripe_spans_check,
                           longer_chunks=True)


def group_spans_default(problem: Problem) -> KernelConfig:
    """Heuristic group_spans configuration: the grouped tiles and chunks of each KV group's keys
    that give about four per multiprocessor, on 8 warps from 64 span rows (compiled for sm_90 with
    64 rows and 64-key 3-stage tiles: 140 bytes of spill stores on 8 warps, 1.5 KB on 4)."""
    config = _decode_default(problem, problem.keys, problem.batch * problem.kv_heads, group_spans_check)
    return config.replace(num_warps=8) if span_rows(problem.rep, problem.spans) >= 64 else config


def _decode_default(problem: Problem, span_keys: int, spans: int, check, longer_chunks: bool = False) -> KernelConfig:
    """The grouped decodes' heuristic: 64-key tiles (32 past D = 128), 4 warps, chunks of ``spans``
    spans of ``span_keys`` keys that give about four programs per multiprocessor (with
    ``longer_chunks``, doubled up to ``span_keys`` until ``check`` passes), and the most stages up to
    3 that ``check`` passes, on narrower key tiles (down to 16) where not even one stage does."""
    block_k = 64 if problem.head_dim <= 128 else 32
    while True:
        chunk = span_chunk_length(span_keys, spans, max(problem.device.multiprocessors, 1), block_k)
        for stages in (3, 2, 1):
            config = KernelConfig(block_k=block_k, num_warps=4, num_stages=stages, chunk=chunk)
            while longer_chunks and check(problem, config) is not None and config.chunk < span_keys:
                config = config.replace(chunk=2 * config.chunk)
            if check(problem, config) is None or (stages == 1 and block_k == MIN_DOT):
                return config
        block_k //= 2


def tc_forward_default(problem: Problem) -> KernelConfig:
    """Heuristic tensor-core forward configuration: the H200 sweep's best tiles for bf16, D <= 128
    (window 128/64/8 warps/3 stages, spans 64/64/4/3), smaller ones for wider rows or fp32, then
    shrunk until they fit the GPU (``fitted``)."""
    from .kernels.span_tc_forward import tc_forward_default as tiles  # imports Triton on first use only

    return fitted(KernelConfig(tiles(problem.head_dim, problem.torch_dtype)), FORWARD_TILES, problem, f"{SPAN_FORWARD}/tc_tiles")


def tc_backward_default(problem: Problem) -> KernelConfig:
    """Heuristic tensor-core backward configuration: the H200 4K-64K sweeps' best (window tiles
    32/128/8 warps/3 stages over 8 parts of a KV group's heads, spans 128/64/8/2 sorted by
    (start // 64, end)), shrunk until they fit (``fitted``)."""
    from .kernels.span_tc_backward import SPAN_TC_BACKWARD_DEFAULTS  # imports Triton on first use only

    return fitted(KernelConfig(SPAN_TC_BACKWARD_DEFAULTS), BACKWARD_TILES, problem, f"{SPAN_BACKWARD}/tc_tiles")


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


def search_default(problem: Problem) -> KernelConfig:
    """Heuristic search tiles (``layer.search_kernel.search_default``)."""
    from .layer.search_kernel import search_default as tiles  # imports Triton on first use only

    return tiles(problem.rep, problem.head_dim)


def stripe_tile_default(problem: Problem) -> KernelConfig:
    """Heuristic stripe-tile search tiles (``layer.stripe_tile_search.stripe_tile_default``), with as
    many more warps as the register estimate asks for."""
    from .layer.stripe_tile_search import stripe_tile_default as tiles

    config = tiles(problem.rep, problem.head_dim)
    while stripe_tile_check(problem, config) is not None and config.num_warps < 8:  # wide tiles: more warps
        config = config.replace(num_warps=2 * config.num_warps)
    return config


def reference_default(problem: Problem) -> KernelConfig:
    """The reference has nothing to configure."""
    return KernelConfig()


def gate_default(problem: Problem) -> KernelConfig:
    """The gate kernels' configuration before they were tuned: 16 rows per program, Triton's default 4 warps."""
    return KernelConfig(block_r=16, num_warps=4)


def rows_check(tiles: int, problem: Problem, config: KernelConfig) -> str | None:
    """Why a gate configuration cannot run well: registers (GPU only), ``tiles`` fp32 [block_r, D] tiles."""
    if not problem.device.is_gpu:
        return None
    per_thread = tiles * config.block_r * next_power_of_two(problem.head_dim) / (32 * config.num_warps)
    if per_thread > MAX_VALUES_PER_THREAD:
        return f"registers: about {per_thread:.0f} fp32 values per thread on {config.num_warps} warps (limit {MAX_VALUES_PER_THREAD})"
    return None
