"""The staged decode's variants, one block each: its space, when it applies, its static checks, its
default and its registration.

Launch signature: ``launch(q1, q2, k, v, cache_position, attention_mask, settings, config) -> out``
[B, Hq, 1, D].
"""

from __future__ import annotations

import math
from functools import partial

from ... import geometry
from ...buckets import next_power_of_two
from ...launch import KernelConfig
from ...problem import STAGED_DECODE, Problem
from ...registry import Param, Variant
from ...settings import SpanSettings
from .. import rules
from ..span_attention.variants import reference_forward, triton_forward
from ..spec import span_length
from .grouped import group_spans_decode, grouped_decode, one_launch_decode, split_merge_decode, stripe_spans_decode
from .grouped_plan import MAX_SPAN_ROWS, MIN_DOT, WINDOW_CHUNK, cdiv, one_launch_rows, pow2, span_chunk_length, span_rows
from .split_window import split_window_decode
from .staged import staged_decode

# --- the launchers built on a span forward --------------------------------------------------------


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


# --- the tensor-core decodes' shared rules ---------------------------------------------------------

# The chunked decodes stream one query's keys: a deeper pipeline keeps more K/V loads in flight per program.
DECODE_TILES = (rules.KEY_BLOCKS, rules.WARPS, Param("num_stages", (1, 2, 3, 4, 6, 8)))
DECODE_SHARED_SLACK = 1024  # bytes beside a decode program's tiles (barriers, reductions: 24 to 312 in sm_90 compiles)


def decode_shared_reason(problem: Problem, block_k: int, buffers: int, rows: int, what: str) -> str | None:
    """Why a tensor-core decode program does not fit the GPU's shared memory (GPU only): ``buffers``
    [block_k, D] K and V tiles, its [rows, D] queries and [rows, block_k] weights staged for the dots,
    and ``DECODE_SHARED_SLACK``. Against sm_90 compiles of model M's grouped, stripe_spans and
    group_spans kernels (every block_k and num_stages, bf16, masked or not) it refuses exactly those
    compiled past the limit. Far from it the estimate can be off either way: one-stage loops compile
    smaller, group_spans' smallest tiles compile to a 48 KB floor."""
    block_d = next_power_of_two(problem.head_dim)
    shared = (buffers * 2 * block_k * block_d + rows * (block_d + block_k)) * rules.element_bytes(problem) + DECODE_SHARED_SLACK
    return rules.shared_reason(shared, what, problem) if problem.device.is_gpu else None


def decode_default(problem: Problem, span_keys: int, spans: int, check, longer_chunks: bool = False) -> KernelConfig:
    """The tensor-core decodes' heuristic: 64-key tiles (32 past D = 128), 4 warps, chunks of ``spans``
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


# --- staged_decode/grouped --------------------------------------------------------------------------

# Keys per span program: powers of two and steps between them (equal pieces of a span, e.g. 448 = 1,785 / 4 at model M's 64K).
GROUPED_SPACE = (*DECODE_TILES, Param("chunk", (128, 192, 256, 384, 448, 512, 768, 896, 1024, 1536, 2048, 3072, 4096)))


def grouped_check(problem: Problem, config: KernelConfig, block_k: int | None = None) -> str | None:
    """Why a grouped configuration cannot build or run well (GPU only): two [block_k x D] fp32 tiles
    past the registers of its warps, or its span program's pipelined K/V tiles (num_stages - 1
    buffers, Triton's pipelining) and its head rows past the shared memory (``block_k``: the key
    block, when a part of the kernel takes wider ones than the config's)."""
    rows = max(next_power_of_two(problem.rep), MIN_DOT)
    return rules.register_reason(2, problem, config) or decode_shared_reason(
        problem, block_k or config.block_k, max(config.num_stages - 1, 1), rows, f"{config.num_stages} stages of K/V tiles")


def grouped_default(problem: Problem) -> KernelConfig:
    """Heuristic grouped configuration (``decode_default`` over the chosen spans of every head)."""
    spans = problem.batch * problem.q_heads * problem.spans
    return decode_default(problem, span_length(problem.factors, problem.keys), spans, grouped_check)


def grouped_reasons(problem: Problem) -> list[str]:
    """Why the grouped decode kernels cannot serve ``problem`` (or not even the smallest tiles fit its GPU)."""
    reasons = rules.triton_reasons(problem)
    if problem.rep > 64:
        reasons.append(f"rep = {problem.rep} > 64 query heads per KV head (one program holds a whole group)")
    return reasons or rules.misfit(problem, grouped_default, grouped_check)


GROUPED = Variant(
    op=STAGED_DECODE, name="grouped", launch=grouped_decode, space=GROUPED_SPACE, reasons=grouped_reasons,
    compile_check=grouped_check, default=grouped_default, priority=0,  # the fastest decode at every context measured
    description="stripe search and window once per KV group, spans in tensor-core chunks, merged by the last: two launches",
)

# --- staged_decode/stripe_spans ----------------------------------------------------------------------

STRIPE_SPANS_SPACE = (*DECODE_TILES, Param("chunk", (64, 96, 128, 192, 256, 384, 512, 1024, 2048, 4096)))
# Keys per KV group in every stripe's span above which stripe_spans does not apply (it wins at short
# contexts only: attending every stripe's span beside the search costs more than waiting for it at
# long ones), and its partials' budget.
STRIPE_SPANS_KEYS = 1 << 19
STRIPE_SPANS_BYTES = 1 << 28


def _stripes_and_longest_span(problem: Problem) -> tuple[int, int]:
    """(stripes of the key length's table, keys of its longest span): what stripe_spans attends per group."""
    stripes = geometry.stripe_count(problem.keys, problem.sw_index, problem.params) - problem.sw_index  # i > sw_index
    return stripes, min(span_length(problem.factors, problem.keys), problem.keys)


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


def stripe_spans_default(problem: Problem) -> KernelConfig:
    """Heuristic stripe_spans configuration: the grouped tiles, with chunks of every stripe's span
    that give about four programs per multiprocessor, made longer until the partials fit."""
    stripes, longest = _stripes_and_longest_span(problem)
    return decode_default(problem, longest, problem.batch * problem.kv_heads * stripes, stripe_spans_check,
                          longer_chunks=True)


def stripe_spans_reasons(problem: Problem) -> list[str]:
    """Why the stripe_spans decode kernels cannot serve ``problem``: the grouped rules, or spans of
    every stripe so long that attending them all cannot pay."""
    reasons = grouped_reasons(problem)
    stripes, longest = _stripes_and_longest_span(problem)
    if stripes * longest > STRIPE_SPANS_KEYS:
        reasons.append(f"every stripe's span is {stripes} x {longest} keys per KV group > {STRIPE_SPANS_KEYS}: "
                       "attending them all beside the search costs more than waiting for it")
    return reasons or rules.misfit(problem, stripe_spans_default, stripe_spans_check)


STRIPE_SPANS = Variant(
    op=STAGED_DECODE, name="stripe_spans", launch=stripe_spans_decode, space=STRIPE_SPANS_SPACE,
    reasons=stripe_spans_reasons, compile_check=stripe_spans_check, default=stripe_spans_default,
    priority=1,  # short contexts only: the tuner chooses it where it wins
    description="stripe search, window and the span of every stripe once per KV group in one launch (no span work "
    "waits for the search), then a merge that picks each head's chosen spans: two launches",
)

# --- staged_decode/group_spans -----------------------------------------------------------------------

# Keys per chunk of key positions: one program walks several; a chunk reads its span keys once.
GROUP_SPANS_SPACE = (*DECODE_TILES, Param("chunk", (64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 8192)))


def row_tile_reason(problem: Problem, config: KernelConfig, rows: int) -> str | None:
    """Why a program that attends ``rows`` query rows per KV group in one tile cannot build or run
    well (GPU only): the grouped resource register rule, the rows' accumulator and scores past the
    registers of its warps, or its tiles past the shared memory (num_stages K/V buffers: no stage is
    saved as in grouped's loop)."""
    if not problem.device.is_gpu:
        return None
    per_thread = rows * (next_power_of_two(problem.head_dim) + config.block_k) / (32 * config.num_warps)
    if per_thread > rules.MAX_VALUES_PER_THREAD:
        return (f"registers: about {per_thread:.0f} fp32 values per thread for {rows} rows' accumulator and "
                f"scores ({config.block_k}-key blocks) on {config.num_warps} warps (limit {rules.MAX_VALUES_PER_THREAD})")
    return rules.register_reason(2, problem, config) or decode_shared_reason(
        problem, config.block_k, config.num_stages, rows, f"{config.num_stages} stages of K/V tiles and {rows} rows")


def group_spans_check(problem: Problem, config: KernelConfig) -> str | None:
    """Why a group_spans configuration cannot build or run well: ``row_tile_reason`` for its (head,
    slot) rows."""
    return row_tile_reason(problem, config, span_rows(problem.rep, problem.spans))


def group_spans_default(problem: Problem) -> KernelConfig:
    """Heuristic group_spans configuration: the grouped tiles and chunks of each KV group's keys
    that give about four per multiprocessor, on 8 warps from 64 span rows (fewer spills: sm_90
    compiles with 64 rows and 64-key 3-stage tiles spill far less on 8 warps than on 4)."""
    config = decode_default(problem, problem.keys, problem.batch * problem.kv_heads, group_spans_check)
    return config.replace(num_warps=8) if span_rows(problem.rep, problem.spans) >= 64 else config


def group_spans_reasons(problem: Problem) -> list[str]:
    """Why the group_spans decode kernels cannot serve ``problem``: the grouped rules, or more
    (head, slot) rows per KV group than one program holds."""
    reasons = grouped_reasons(problem)
    if span_rows(problem.rep, problem.spans) > MAX_SPAN_ROWS:
        reasons.append(f"rep {problem.rep} x topk {problem.spans} span rows per KV group > {MAX_SPAN_ROWS} (one program holds a group's rows)")
    return reasons or rules.misfit(problem, group_spans_default, group_spans_check)


GROUP_SPANS = Variant(
    op=STAGED_DECODE, name="group_spans", launch=group_spans_decode, space=GROUP_SPANS_SPACE,
    reasons=group_spans_reasons, compile_check=group_spans_check, default=group_spans_default,
    priority=4,  # after every other kernel decode (slower than grouped where measured); the tuner chooses it where it wins
    description="stripe search and window once per KV group, then per chunk of key positions every chosen span of "
    "the group's heads, each key read once for all of them, then a merge per head: three launches",
)

# --- staged_decode/one_launch and split_merge (the keys split over programs) -----------------------

# Key positions per program (the search is repeated in each: longer splits repeat it less).
ONE_LAUNCH_CHUNKS = (128, 256, 512, 1024, 2048, 4096)
ONE_LAUNCH_SPACE = (*DECODE_TILES, Param("chunk", ONE_LAUNCH_CHUNKS))
# Keys above which neither applies (every program repeats the group's search over the whole
# stripe table, a few dozen key rows at short contexts, hundreds past them), and the partials'
# budget (one per row and split).
ONE_LAUNCH_KEYS = 1 << 17
ONE_LAUNCH_MIN_CHUNK = 512
ONE_LAUNCH_BYTES = 1 << 28
# split_merge: a merge program holds a slot's partials of every split at once; its merge is
# parallel, so shorter splits pay.
SPLIT_MERGE_SPLITS = 64
SPLIT_MERGE_MIN_CHUNK = 128


def one_launch_check(problem: Problem, config: KernelConfig) -> str | None:
    """Why a one_launch configuration cannot build or run well: partials (one per row and split)
    above ``ONE_LAUNCH_BYTES``, or ``row_tile_reason`` for its (slot, head) rows."""
    rows = one_launch_rows(problem.rep, problem.spans)
    partials = problem.batch * problem.kv_heads * -(-problem.keys // config.chunk) * rows * (problem.head_dim + 2) * 4
    if partials > ONE_LAUNCH_BYTES:
        return (f"partials: {partials / 2**20:.0f} MiB for splits of {config.chunk} keys > "
                f"{ONE_LAUNCH_BYTES >> 20} MiB (take longer splits)")
    return row_tile_reason(problem, config, rows)


def split_merge_check(problem: Problem, config: KernelConfig) -> str | None:
    """Why a split_merge configuration cannot build or run well: more than ``SPLIT_MERGE_SPLITS``
    splits, or ``one_launch_check``."""
    splits = cdiv(problem.keys, config.chunk)
    if splits > SPLIT_MERGE_SPLITS:
        return (f"chunk: {splits} splits of {config.chunk} keys > {SPLIT_MERGE_SPLITS} (a merge program holds "
                "every split's partial at once; take longer splits)")
    return one_launch_check(problem, config)


def _split_keys_default(problem: Problem, check, min_chunk: int, programs_per_multiprocessor: float) -> KernelConfig:
    """``decode_default``'s tiles on 4 warps, with splits of at least ``min_chunk`` keys and about
    ``programs_per_multiprocessor`` programs per multiprocessor, made longer until ``check`` passes."""
    groups = problem.batch * problem.kv_heads
    config = decode_default(problem, problem.keys, groups, check, longer_chunks=True)
    programs = max(problem.device.multiprocessors, 1) * programs_per_multiprocessor
    per_program = pow2(math.ceil(problem.keys * groups / programs))
    return config.replace(chunk=max(config.chunk, min_chunk, min(per_program, max(ONE_LAUNCH_CHUNKS))))


def one_launch_default(problem: Problem) -> KernelConfig:
    """Heuristic one_launch configuration (``_split_keys_default``: splits of at least
    ``ONE_LAUNCH_MIN_CHUNK``, about one program per multiprocessor, as the last program merges them
    one after another). On an H100 at model M's 4K this picks the fastest chunk of a sweep at B 1,
    4 and 16."""
    return _split_keys_default(problem, one_launch_check, ONE_LAUNCH_MIN_CHUNK, 1)


def split_merge_default(problem: Problem) -> KernelConfig:
    """Heuristic split_merge configuration (``_split_keys_default``: splits of at least
    ``SPLIT_MERGE_MIN_CHUNK``, about one program per two multiprocessors). On an H100 at model M's
    4K this picks the fastest chunk of a sweep at B 1, 4 and 16 (128, 512 and 2048 keys)."""
    return _split_keys_default(problem, split_merge_check, SPLIT_MERGE_MIN_CHUNK, 0.5)


def _split_keys_reasons(problem: Problem, default, check) -> list[str]:
    """Why a decode with the keys split over programs cannot serve ``problem``: the grouped rules,
    more rows per KV group than one program holds, or so many keys that repeating the search in
    every program cannot pay."""
    reasons = grouped_reasons(problem)
    rows = one_launch_rows(problem.rep, problem.spans)
    if rows > MAX_SPAN_ROWS:
        reasons.append(f"rep {problem.rep} x (topk {problem.spans} + the window) rows per KV group = {rows} > "
                       f"{MAX_SPAN_ROWS} (one program holds a group's rows)")
    if problem.keys > ONE_LAUNCH_KEYS:
        reasons.append(f"keys = {problem.keys} > {ONE_LAUNCH_KEYS}: every program repeats the group's search over the "
                       "whole stripe table")
    return reasons or rules.misfit(problem, default, check)


ONE_LAUNCH = Variant(
    op=STAGED_DECODE, name="one_launch", launch=one_launch_decode, space=ONE_LAUNCH_SPACE,
    reasons=partial(_split_keys_reasons, default=one_launch_default, check=one_launch_check),
    compile_check=one_launch_check, default=one_launch_default,
    priority=5,  # short contexts only: the tuner chooses it where it wins
    description="stripe search, spans, window and gate per KV group in one launch, its keys split over programs "
    "(every key a row attends read once for the group), merged by the last program",
)
SPLIT_MERGE = Variant(
    op=STAGED_DECODE, name="split_merge", launch=split_merge_decode, space=ONE_LAUNCH_SPACE,
    reasons=partial(_split_keys_reasons, default=split_merge_default, check=split_merge_check),
    compile_check=split_merge_check, default=split_merge_default,
    priority=6,  # short contexts only: the tuner chooses it where it wins
    description="one_launch's search, spans and window per KV group over split keys, merged by a second launch, "
    "one program per head",
)

# --- staged_decode/split_window and staged (baselines), staged_reference --------------------------

SPLIT_WINDOW = Variant(
    op=STAGED_DECODE, name="split_window", launch=position_clamped(split_window_decode), space=rules.FORWARD_SPACE,
    baseline=True, reasons=rules.triton_reasons, compile_check=partial(rules.resource_check, 2), default=rules.forward_default, priority=2,
    description="fused stripe search, then span/window attention in 256-key chunks merged once per head with the gate",
)
STAGED = Variant(
    op=STAGED_DECODE, name="staged", launch=position_clamped(staged_decode_with(triton_forward)), space=rules.FORWARD_SPACE,
    baseline=True, reasons=rules.triton_reasons, compile_check=partial(rules.resource_check, 2), default=rules.forward_default, priority=3,
    description="stripe search and top-k in PyTorch, span attention by the per-(query, span) Triton forward",
)
STAGED_REFERENCE = Variant(
    op=STAGED_DECODE, name="staged_reference", launch=position_clamped(staged_decode_with(reference_forward)), space=(),
    reasons=rules.always_applies, compile_check=rules.no_check, default=rules.reference_default, priority=100,
    description="stripe search and top-k in PyTorch, span attention by the PyTorch reference",
)

VARIANTS: tuple[Variant, ...] = (
    GROUPED, STRIPE_SPANS, SPLIT_WINDOW, STAGED, GROUP_SPANS, ONE_LAUNCH, SPLIT_MERGE, STAGED_REFERENCE,
)
