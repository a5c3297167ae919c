"""The grids and buffer sizes of a grouped decode launch (``grouped_kernels``), from shapes alone."""

from __future__ import annotations

import functools
from typing import NamedTuple

MIN_DOT = 16  # smallest tl.dot extent
WINDOW_CHUNK = 64  # keys per window program (one tensor-core step: window programs finish early)
MAX_SPAN_ROWS = 128  # (head, slot) rows one group_spans program holds


def cdiv(a: int, b: int) -> int:
    """ceil(a / b)."""
    return -(-a // b)


def pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def span_chunk_length(span_keys: int, spans: int, multiprocessors: int, block_k: int) -> int:
    """Keys per span program: enough programs to keep every multiprocessor busy a few times over."""
    chunk = pow2(max(cdiv(span_keys * spans, 4 * multiprocessors), 1))
    return max(min(chunk, 1024), 128, block_k)


def span_rows(rep: int, topk: int) -> int:
    """Rows of a ``group_spans_kernels`` program: one per (head, slot) of a KV group, padded to a
    power of two of at least one tensor-core tile."""
    return max(pow2(rep * topk), MIN_DOT)


def one_launch_rows(rep: int, topk: int) -> int:
    """Rows of a ``split_keys_kernels`` program: ``topk`` span slots and the window, each of ``rep``
    heads padded to a power of two of at least one tensor-core tile."""
    return pow2(topk + 1) * max(pow2(rep), MIN_DOT)


class LaunchPlan(NamedTuple):
    """Everything a grouped decode launch derives from shapes and settings (cached per shape)."""

    rep: int
    rep_pad: int
    block_d: int
    n_blocks: int
    n_candidates: int
    chunk: int
    n_chunks: int  # chunks per span
    stripe_programs: int  # per KV group: a program per (stripe, chunk) of every stripe's span (stripe_spans), else 0
    n_wchunks: int
    n_slices: int
    slice_programs: int
    work_sizes: tuple[int, ...]  # span acc, m, l; window acc, m, l; chosen scores; candidate scores
    count_sizes: tuple[int, ...]  # candidate stripes, finished-program counters, mask-slice minima


@functools.lru_cache(maxsize=1024)
def launch_plan(
    batch: int, hq: int, hkv: int, lkv: int, dim: int, topk: int, window: int, n_stripes: int,
    longest_span: int, block_k: int, chunk: int | None, block_s: int, first_from_mask: bool, mask_slice: int,
    multiprocessors: int, stripe_spans: bool = False,
) -> LaunchPlan:
    """The grids and buffer sizes of one grouped decode shape: span partials per (head, slot, chunk),
    or with ``stripe_spans`` per (head, stripe, chunk) for every stripe of the table."""
    n_blocks = cdiv(n_stripes, block_s)
    n_candidates = n_blocks * topk
    spans = batch * hkv * n_stripes if stripe_spans else batch * hq * topk
    chunk = chunk or span_chunk_length(longest_span, spans, multiprocessors, block_k)
    n_chunks = cdiv(longest_span, chunk)
    n_wchunks = max(cdiv(window, WINDOW_CHUNK), 1)
    first_from_slices = first_from_mask and not stripe_spans  # stripe_spans programs find the first key themselves
    n_slices = cdiv(lkv, mask_slice) if first_from_slices else 1
    rows = batch * hq
    span_parts, window_parts = rows * (n_stripes if stripe_spans else topk) * n_chunks, rows * n_wchunks
    return LaunchPlan(
        rep=hq // hkv, rep_pad=max(pow2(hq // hkv), MIN_DOT), block_d=max(pow2(dim), MIN_DOT),
        n_blocks=n_blocks, n_candidates=n_candidates, chunk=chunk, n_chunks=n_chunks,
        stripe_programs=n_stripes * n_chunks if stripe_spans else 0, n_wchunks=n_wchunks,
        n_slices=n_slices, slice_programs=cdiv(n_slices, hkv) if first_from_slices else 0,
        work_sizes=(span_parts * dim, span_parts, span_parts, window_parts * dim, window_parts, window_parts,
                    rows * topk, rows * n_candidates),
        count_sizes=(rows * n_candidates, rows, batch * n_slices),
    )
