"""Span attention's forward for sm_90 in Gluon: window and span tiles fed by a TMA producer warp to
consumer warpgroups on wgmma, as in FlashAttention-3.

The numbers and plan of ``span_forward_tc`` (tile_forward.py): the window part of every query once,
then the spans in tiles of sorted (head, query, slot) triples, each row merged with its window part
by log-sum-exp. Both kernels attend a tile of 128 rows, each over its own key range [lo, hi] of one
KV group: the launching warpgroup finds the tile's range [min lo, max hi] and sets up shared memory,
then three partitions run side by side:

- a one-warp producer loads the range's key blocks through the tensor memory accelerator into a
  ring of ``STAGES`` shared-memory K and V buffers (an mbarrier per buffer that its loads fill, one
  that both consumers free), keeping 24 registers so that the consumers get 240;
- two consumer warpgroups, 64 rows each, gather their query rows and compute (``_attend_rows``):
  the scores of block j on the tensor cores while block j-1's probabilities meet its values, so
  the softmax of one block overlaps the other's matrix work; per-row [lo, hi] masks only on the
  blocks that not every row attends (the range's first and last). Each frees a buffer on its own,
  so neither waits for the other's softmax; with ``PINGPONG`` they issue their matrix work in
  turns (an mbarrier each), one warpgroup's softmax running beside the other's dots.

Keys the last block loads past the range (up to ``BLOCK_N`` - 1 of them: later keys of the group,
which an unwritten static cache holds as NaN, or the next group's) get zero weight, and their
values are zeroed in shared memory before they meet the weights, so no key outside the range ever
reaches an output. Keys inside the range (the hull of the rows' ranges, gaps between them included)
are written keys of the cache, expected to be finite: a NaN value there reaches every row of the
tile, as 0 * NaN in the shared dot.
Unmasked problems only (an attention mask would hide keys inside the range). Gluon's warp
specialisation and wgmma need an sm_90 GPU: Triton's interpreter does not run these kernels, so
they are tested on the GPU against the float64 oracle and refused with a reason elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ...launch import LaunchGeometry, forward_outputs
from ..kernel_helpers import LOG2E
from ..side_stream import SideStream
from .span_tiles import span_tile_plan
from .tile_forward import SPAN_START_BLOCK
from .window_forward import block_d, row_descriptors

HALF_ROWS = gl.constexpr(64)  # query rows per consumer warpgroup; a tile holds two
TILE_ROWS = gl.constexpr(2 * HALF_ROWS.value)
CONSUMER_REGISTERS = gl.constexpr(240)  # each consumer warpgroup's registers after reallocation
PRODUCER_REGISTERS = gl.constexpr(24)  # the producer warp only issues TMA loads and waits on barriers


@gluon.constexpr_function
def _mma_layout(cols):
    """The wgmma accumulator layout of a consumer warpgroup's [64, cols] tiles."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, cols, 16])


@gluon.constexpr_function
def _row_layout():
    """A consumer warpgroup's [64, D] layout for pointer loads and shared-memory passes: 8 contiguous elements per thread."""
    return gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])


@gluon.constexpr_function
def _tile_layout():
    """The launching warpgroup's layout of a tile's 128 rows, for its extent."""
    return gl.BlockedLayout([1], [32], [4], [0])


@gluon.jit
def _tile_extent(row_lo, row_hi, BLOCK_N: gl.constexpr):
    """(tile_lo, tile_hi, n_blocks, first_inner, end_inner) of the tile's rows' key ranges [lo, hi]
    (a row with hi < lo attends nothing): the key blocks [tile_lo, tile_hi] in BLOCK_N steps, the
    blocks [first_inner, end_inner) that every row attends whole, so unmasked."""
    present = row_hi >= row_lo
    tile_hi = gl.max(gl.where(present, row_hi, -1), axis=0)
    tile_lo = gl.minimum(gl.min(gl.where(present, row_lo, 2**30), axis=0), tile_hi + 1)
    n_blocks = gl.cdiv(tile_hi - tile_lo + 1, BLOCK_N)
    inner_lo = gl.max(gl.where(present, row_lo, -1), axis=0)
    inner_hi = gl.minimum(gl.min(gl.where(present, row_hi, 2**30), axis=0), tile_hi)
    first_inner = gl.minimum(gl.cdiv(gl.maximum(inner_lo - tile_lo, 0), BLOCK_N), n_blocks)
    end_inner = gl.maximum(gl.minimum((inner_hi - tile_lo + 1) // BLOCK_N, n_blocks), first_inner)
    return tile_lo, tile_hi, n_blocks, first_inner, end_inner


@gluon.jit
def _allocate_ring(q_dtype, k_desc, v_desc, BLOCK_D: gl.constexpr, STAGES: gl.constexpr):
    """Shared memory of a tile: the two consumers' query halves, ``STAGES`` K and V buffers, and
    the barriers: a buffer's K and V loaded (one each), freed (both consumers), each consumer's
    turn to issue its matrix work (``turn``; the first consumer's first turn already given), the
    last value block's rows past the range zeroed (``zeroed``). A consumer frees a buffer only after
    waiting for the next block's keys, so one buffer would deadlock: ``STAGES`` >= 2."""
    gl.static_assert(STAGES >= 2, "the K/V ring needs two buffers or more")
    q_halves = gl.allocate_shared_memory(q_dtype, [2, HALF_ROWS, BLOCK_D],
                                         gl.NVMMASharedLayout.get_default_for([HALF_ROWS, BLOCK_D], q_dtype))
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, k_desc.block_type.shape[0], BLOCK_D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, v_desc.block_type.shape[0], BLOCK_D], v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    zeroed = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(free.index(i), count=2)
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    mbarrier.init(zeroed, count=1)
    fence_async_shared()
    mbarrier.arrive(turn.index(0), count=1)
    return q_halves, (k_bufs, v_bufs, k_ready, v_ready, free, turn, zeroed)


@gluon.jit
def _kv_producer(k_desc, v_desc, ring, first_key_row, n_blocks, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Block j's K and V into buffer j % STAGES once both consumers have freed it."""
    k_bufs, v_bufs, k_ready, v_ready, free, turn, zeroed = ring
    for j in range(n_blocks):
        stage = j % STAGES
        mbarrier.wait(free.index(stage), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [first_key_row + j * BLOCK_N, 0], k_ready.index(stage), k_bufs.index(stage))
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [first_key_row + j * BLOCK_N, 0], v_ready.index(stage), v_bufs.index(stage))


@gluon.jit
def _block_probabilities(s, m, l, key0, row_lo, row_hi, masked, qk_scale, BLOCK_N: gl.constexpr):
    """One online-softmax step on raw scores ``s`` of keys key0.. (per-row [lo, hi] masks where
    ``masked``): (probabilities, new max, rescale of the old state, new sum), log2 domain; a row
    that has attended nothing yet keeps max -inf and sum 0."""
    if masked:
        keys = key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        keep = (keys[None, :] >= row_lo[:, None]) & (keys[None, :] <= row_hi[:, None])
        s = gl.where(keep, s, float("-inf"))
    m_new = gl.maximum(m, gl.max(s, axis=1) * qk_scale)
    m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m - m_ref)
    p = gl.exp2(s * qk_scale - m_ref[:, None])
    return p, m_new, alpha, l * alpha + gl.sum(p, axis=1)


@gluon.jit
def _zero_values_past(v_buf, key0, tile_hi, BLOCK_N: gl.constexpr):
    """Zero the rows of the value block of keys key0.. that lie past ``tile_hi``, for the wgmmas that read it next."""
    layout: gl.constexpr = _row_layout()
    values = v_buf.load(layout)
    keys = key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    v_buf.store(gl.where(keys[:, None] <= tile_hi, values, gl.zeros_like(values)))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _issue_turn(turn, HALF: gl.constexpr, event, PINGPONG: gl.constexpr, start: gl.constexpr):
    """With ``PINGPONG``: wait for this consumer's turn to issue matrix work (``start``), or hand the turn on."""
    if PINGPONG:
        if start:
            mbarrier.wait(turn.index(HALF), event & 1)
        else:
            mbarrier.arrive(turn.index(1 - HALF), count=1)


@gluon.jit
def _attend_rows(q_smem, ring, row_lo, row_hi, extent, qk_scale, HALF: gl.constexpr, BLOCK_N: gl.constexpr,
                 BLOCK_D: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr):
    """(acc, m, l) of one consumer's 64 rows over the tile's key blocks, row r over keys [row_lo[r],
    row_hi[r]]: block j's scores computed while block j-1's probabilities meet its values; with
    ``PINGPONG`` the two consumers issue their matrix work in turns, one's softmax beside the
    other's dots. Rows that attend no key come back as (0, -inf, 0)."""
    k_bufs, v_bufs, k_ready, v_ready, free, turn, zeroed = ring
    tile_lo, tile_hi, n_blocks, first_inner, end_inner = extent
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(BLOCK_D)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    zero_s = gl.zeros([HALF_ROWS, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([HALF_ROWS, BLOCK_D], gl.float32, o_layout)
    m = gl.full([HALF_ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l = gl.zeros([HALF_ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    if n_blocks > 0:
        mbarrier.wait(k_ready.index(0), 0)
        _issue_turn(turn, HALF, 0, PINGPONG, True)
        s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        _issue_turn(turn, HALF, 0, PINGPONG, False)
        s = warpgroup_mma_wait(0, deps=(s,))
        p, m, alpha, l = _block_probabilities(s, m, l, tile_lo, row_lo, row_hi, (first_inner > 0) | (end_inner < 1),
                                              qk_scale, BLOCK_N)
        for j in range(1, n_blocks):
            stage = j % STAGES
            prev = (j - 1) % STAGES
            p_op = gl.convert_layout(p.to(v_bufs.dtype), p_layout)
            mbarrier.wait(k_ready.index(stage), (j // STAGES) & 1)
            mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
            _issue_turn(turn, HALF, j, PINGPONG, True)
            s = warpgroup_mma(q_smem, k_bufs.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            acc = warpgroup_mma(p_op, v_bufs.index(prev), acc, is_async=True)
            _issue_turn(turn, HALF, j, PINGPONG, False)
            s = warpgroup_mma_wait(1, deps=(s,))
            p, m, alpha, l = _block_probabilities(s, m, l, tile_lo + j * BLOCK_N, row_lo, row_hi,
                                                  (j < first_inner) | (j >= end_inner), qk_scale, BLOCK_N)
            acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
            mbarrier.arrive(free.index(prev), count=1)
            acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        last = (n_blocks - 1) % STAGES
        last_key0 = tile_lo + (n_blocks - 1) * BLOCK_N
        mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // STAGES) & 1)
        if last_key0 + BLOCK_N - 1 > tile_hi:  # keys past the range: one consumer zeroes their values for both
            if HALF == 0:
                _zero_values_past(v_bufs.index(last), last_key0, tile_hi, BLOCK_N)
                mbarrier.arrive(zeroed, count=1)
            else:
                mbarrier.wait(zeroed, 0)
        p_op = gl.convert_layout(p.to(v_bufs.dtype), p_layout)
        acc = warpgroup_mma(p_op, v_bufs.index(last), acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
    # Rows that attend no key come back as (0, -inf, 0), whatever the shared blocks held.
    present = gl.convert_layout(row_hi >= row_lo, o_rows)
    m = gl.convert_layout(m, o_rows)
    l = gl.convert_layout(l, o_rows)
    return gl.where(present[:, None], acc, 0.0), gl.where(present, m, float("-inf")), gl.where(present, l, 0.0)


@gluon.jit
def _gather_queries(Q_ptr, q_smem, q_base, q_ok, D_HEAD: gl.constexpr, BLOCK_D: gl.constexpr):
    """A consumer's query rows (element offsets ``q_base`` [64] in ``_row_layout``'s row slice,
    zeros where not ``q_ok``) by pointer loads into its shared tile, ready for its dots."""
    offs_d = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, _row_layout()))
    q = gl.load(Q_ptr + q_base[:, None] + offs_d[None, :], mask=q_ok[:, None] & (offs_d[None, :] < D_HEAD), other=0.0)
    q_smem.store(q)
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _window_rows(cache_pos_ptr, rows, L_Q, L_KV, WINDOW):
    """Key ranges [lo, hi] of the window part of queries ``rows`` (hi < lo past the last query)."""
    row_ok = rows < L_Q
    pos = gl.minimum(gl.load(cache_pos_ptr + rows, mask=row_ok, other=-1), L_KV - 1)
    return gl.maximum(pos - WINDOW + 1, 0), gl.where(row_ok, pos, -1)


@gluon.jit
def _window_consumer(io, q_halves, ring, extent, qk_scale, HALF: gl.constexpr, D_HEAD: gl.constexpr,
                     BLOCK_D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr):
    """One consumer's 64 queries of a window tile (``io``: the kernel's tensors and sizes):
    normalised fp32 output and log2 LSE."""
    Q_ptr, cache_pos_ptr, Ow_ptr, Lw_ptr, stride_qb, stride_qh, stride_ql, H_Q, L_Q, L_KV, WINDOW = io
    head = gl.program_id(0).to(gl.int64)
    first = gl.program_id(1) * TILE_ROWS + HALF * HALF_ROWS
    batch = gl.program_id(2).to(gl.int64)
    o_layout: gl.constexpr = _mma_layout(BLOCK_D)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

    row_lo, row_hi = _window_rows(cache_pos_ptr, first + gl.arange(0, HALF_ROWS, layout=gl.SliceLayout(1, _mma_layout(BLOCK_N))),
                                  L_Q, L_KV, WINDOW)
    offs_q = first + gl.arange(0, HALF_ROWS, layout=gl.SliceLayout(1, _row_layout()))
    q_smem = q_halves.index(HALF)
    _gather_queries(Q_ptr, q_smem, batch * stride_qb + head * stride_qh + offs_q.to(gl.int64) * stride_ql, offs_q < L_Q,
                    D_HEAD, BLOCK_D)
    acc, m, l = _attend_rows(q_smem, ring, row_lo, row_hi, extent, qk_scale, HALF, BLOCK_N, BLOCK_D, STAGES, PINGPONG)

    has_keys = (l > 0.0) | (l != l)  # noqa: PLR0124 - NaN must reach the output, not read as "no key"
    l_safe = gl.where(has_keys, l, 1.0)
    rows = first + gl.arange(0, HALF_ROWS, layout=o_rows)
    rows_ok = rows < L_Q
    out_rows = (batch * H_Q + head) * L_Q + rows
    cols = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, o_layout))
    out = gl.where(has_keys[:, None], acc / l_safe[:, None], 0.0)
    gl.store(Ow_ptr + out_rows[:, None] * D_HEAD + cols[None, :], out, mask=rows_ok[:, None] & (cols[None, :] < D_HEAD))
    gl.store(Lw_ptr + out_rows, gl.where(has_keys, m + gl.log2(l_safe), float("-inf")), mask=rows_ok)


@gluon.jit
def hopper_window_kernel(
    Q_ptr, k_desc, v_desc, cache_pos_ptr, Ow_ptr, Lw_ptr, stride_qb, stride_qh, stride_ql, H_Q, L_Q, L_KV, REP, WINDOW,
    qk_scale, D_HEAD: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    PINGPONG: gl.constexpr,
):
    """The window part of 128 consecutive queries of one head: normalised fp32 output and log2 LSE
    (``-inf`` where the row attends no key), as ``window_attention_kernel``."""
    head = gl.program_id(0)  # the heads of a KV group run one after another: their key blocks stay in L2
    batch = gl.program_id(2).to(gl.int64)
    row_lo, row_hi = _window_rows(cache_pos_ptr, gl.program_id(1) * TILE_ROWS + gl.arange(0, TILE_ROWS, layout=_tile_layout()),
                                  L_Q, L_KV, WINDOW)
    extent = _tile_extent(row_lo, row_hi, BLOCK_N)
    q_halves, ring = _allocate_ring(Q_ptr.dtype.element_ty, k_desc, v_desc, BLOCK_D, STAGES)
    first_key_row = ((batch * (H_Q // REP) + head // REP) * L_KV + extent[0]).to(gl.int32)
    io = (Q_ptr, cache_pos_ptr, Ow_ptr, Lw_ptr, stride_qb, stride_qh, stride_ql, H_Q, L_Q, L_KV, WINDOW)
    gl.warp_specialize([
        (_window_consumer, (io, q_halves, ring, extent, qk_scale, 0, D_HEAD, BLOCK_D, BLOCK_N, STAGES, PINGPONG)),
        (_window_consumer, (io, q_halves, ring, extent, qk_scale, 1, D_HEAD, BLOCK_D, BLOCK_N, STAGES, PINGPONG)),
        (_kv_producer, (k_desc, v_desc, ring, first_key_row, extent[2], BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])


@gluon.jit
def _span_consumer(io, q_halves, ring, extent, qk_scale, HALF: gl.constexpr, K_SPANS: gl.constexpr,
                   D_HEAD: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   PINGPONG: gl.constexpr):
    """One consumer's 64 rows of a span tile (``io``: the kernel's tensors and sizes): each row's
    span part merged with its window part, written as ``span_tile_kernel`` writes it."""
    Q_ptr, order_ptr, lo_ptr, hi_ptr, Ow_ptr, Lw_ptr, Out_ptr, Lse_ptr, stride_qb, stride_qh, stride_ql, H_KV, L_Q, N_TRIPLES, REP = io
    first = gl.program_id(0) * TILE_ROWS + HALF * HALF_ROWS
    group = gl.program_id(1).to(gl.int64)
    o_layout: gl.constexpr = _mma_layout(BLOCK_D)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

    row_lo, row_hi = _span_rows(lo_ptr, hi_ptr, group, first + gl.arange(0, HALF_ROWS, layout=gl.SliceLayout(1, _mma_layout(BLOCK_N))),
                                N_TRIPLES)
    offs_q = first + gl.arange(0, HALF_ROWS, layout=gl.SliceLayout(1, _row_layout()))
    q_ok = offs_q < N_TRIPLES
    triple = gl.load(order_ptr + group * N_TRIPLES + offs_q, mask=q_ok, other=0)
    head = (group % H_KV) * REP + triple // (L_Q * K_SPANS)
    query = (triple // K_SPANS) % L_Q
    q_smem = q_halves.index(HALF)
    _gather_queries(Q_ptr, q_smem, (group // H_KV) * stride_qb + head * stride_qh + query * stride_ql, q_ok, D_HEAD, BLOCK_D)
    acc, m, l = _attend_rows(q_smem, ring, row_lo, row_hi, extent, qk_scale, HALF, BLOCK_N, BLOCK_D, STAGES, PINGPONG)

    rows = first + gl.arange(0, HALF_ROWS, layout=o_rows)
    rows_ok = rows < N_TRIPLES
    out_rows = group * N_TRIPLES + gl.load(order_ptr + group * N_TRIPLES + rows, mask=rows_ok, other=0)
    cols = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, o_layout))
    io_mask = rows_ok[:, None] & (cols[None, :] < D_HEAD)
    # Merge with the window part (normalised output ow, log2 LSE lw) by log-sum-exp.
    w_rows = out_rows // K_SPANS
    lw = gl.load(Lw_ptr + w_rows, mask=rows_ok, other=float("-inf"))
    ow = gl.load(Ow_ptr + w_rows[:, None] * D_HEAD + cols[None, :], mask=io_mask, other=0.0)
    m_new = gl.maximum(m, lw)
    m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m - m_ref)
    beta = gl.exp2(lw - m_ref)
    l = l * alpha + beta
    acc = acc * alpha[:, None] + ow * beta[:, None]
    m = m_new
    has_keys = (l > 0.0) | (l != l)  # noqa: PLR0124 - NaN must reach the output, not read as "no key"
    l_safe = gl.where(has_keys, l, 1.0)
    out = gl.where(has_keys[:, None], acc / l_safe[:, None], 0.0)
    gl.store(Out_ptr + out_rows[:, None] * D_HEAD + cols[None, :], out.to(Out_ptr.dtype.element_ty), mask=io_mask)
    gl.store(Lse_ptr + out_rows, gl.where(has_keys, m + gl.log2(l_safe), float("inf")), mask=rows_ok)


@gluon.jit
def _span_rows(lo_ptr, hi_ptr, group, rows, N_TRIPLES):
    """Key ranges [lo, hi] of the plan's rows ``rows`` of the group (hi < lo past its last triple)."""
    row_ok = rows < N_TRIPLES
    plan = group * N_TRIPLES + rows
    return gl.load(lo_ptr + plan, mask=row_ok, other=0), gl.load(hi_ptr + plan, mask=row_ok, other=-1)


@gluon.jit
def hopper_span_tile_kernel(
    Q_ptr, k_desc, v_desc, order_ptr, lo_ptr, hi_ptr, Ow_ptr, Lw_ptr, Out_ptr, Lse_ptr,
    stride_qb, stride_qh, stride_ql, H_KV, L_Q, L_KV, N_TRIPLES, REP, qk_scale,
    K_SPANS: gl.constexpr, D_HEAD: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    PINGPONG: gl.constexpr,
):
    """One tile of 128 sorted (head, query, slot) triples of a KV group (``span_tile_plan``)."""
    group = gl.program_id(1).to(gl.int64)
    row_lo, row_hi = _span_rows(lo_ptr, hi_ptr, group, gl.program_id(0) * TILE_ROWS + gl.arange(0, TILE_ROWS, layout=_tile_layout()),
                                N_TRIPLES)
    extent = _tile_extent(row_lo, row_hi, BLOCK_N)
    q_halves, ring = _allocate_ring(Q_ptr.dtype.element_ty, k_desc, v_desc, BLOCK_D, STAGES)
    io = (Q_ptr, order_ptr, lo_ptr, hi_ptr, Ow_ptr, Lw_ptr, Out_ptr, Lse_ptr, stride_qb, stride_qh, stride_ql, H_KV, L_Q,
          N_TRIPLES, REP)
    gl.warp_specialize([
        (_span_consumer, (io, q_halves, ring, extent, qk_scale, 0, K_SPANS, D_HEAD, BLOCK_D, BLOCK_N, STAGES, PINGPONG)),
        (_span_consumer, (io, q_halves, ring, extent, qk_scale, 1, K_SPANS, D_HEAD, BLOCK_D, BLOCK_N, STAGES, PINGPONG)),
        (_kv_producer, (k_desc, v_desc, ring, (group * L_KV + extent[0]).to(gl.int32), extent[2], BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])


def tma_readable(geo: LaunchGeometry) -> bool:
    """Whether K and V are one evenly spaced run of 16-byte aligned rows, which TMA reads (``row_descriptors``)."""
    return row_descriptors(geo.k, geo.v, 64) is not None


def hopper_descriptors(k: torch.Tensor, v: torch.Tensor, block_n: int, block_d: int) -> tuple[TensorDescriptor, TensorDescriptor]:
    """Gluon TMA descriptors of K and V [B, Hkv, Lkv, D] as one run of [B * Hkv * Lkv, D] rows in
    [block_n, block_d] blocks (the caller has checked that the rows are one evenly spaced run)."""
    batch, hkv, lkv, dim = k.shape
    layout = gl.NVMMASharedLayout.get_default_for([block_n, block_d], gl.bfloat16 if k.dtype == torch.bfloat16 else gl.float16)
    rows = [batch * hkv * lkv, dim]
    return (TensorDescriptor(k, rows, [k.stride(2), 1], [block_n, block_d], layout),
            TensorDescriptor(v, rows, [v.stride(2), 1], [block_n, block_d], layout))


def hopper_window(geo: LaunchGeometry, config: Mapping[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The window part of every (b, h, q) by ``hopper_window_kernel``: (output [B, Hq, Lq, D] fp32,
    normalised; lse2 [B, Hq, Lq] fp32), as ``window_attention``. ``config``: ``window_block_n``,
    ``window_stages`` and ``window_mma_turns``. The caller has checked that K and V allow TMA (``row_descriptors``)."""
    q, k = geo.q, geo.k
    batch, hq, lq, dim = q.shape
    out = torch.empty(batch, hq, lq, dim, device=q.device, dtype=torch.float32)
    lse = torch.empty(batch, hq, lq, device=q.device, dtype=torch.float32)
    hopper_window_kernel[(hq, triton.cdiv(lq, TILE_ROWS), batch)](
        q, *hopper_descriptors(k, geo.v, config["window_block_n"], block_d(dim)), geo.cache_position, out, lse,
        q.stride(0), q.stride(1), q.stride(2), hq, lq, k.shape[2], geo.rep, geo.window, LOG2E / math.sqrt(dim),
        D_HEAD=dim, BLOCK_D=block_d(dim), BLOCK_N=config["window_block_n"], STAGES=config["window_stages"],
        PINGPONG=config["window_mma_turns"] == 2, num_warps=4,
    )
    return out, lse


def span_forward_hopper(geo: LaunchGeometry, config: Mapping[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The span forward with the Gluon kernels: (out [B, Hq, Lq, K, D] in Q's dtype, lse2 [B, Hq, Lq,
    K] fp32), the numbers of ``tile_forward.span_forward_tc``. ``config``: the window kernel's
    (``hopper_window``) and ``span_block_n``, ``span_stages`` and ``span_mma_turns`` (keys per K/V
    buffer, buffers, and 2 where the two consumers issue their matrix work in turns, 1 where each
    issues as it is ready). The caller has checked the variant's conditions (an sm_90 GPU, 16-bit
    inputs, no mask) and that K and V allow TMA (``tma_readable``)."""
    q, k = geo.q, geo.k
    block_n, dim = config["span_block_n"], q.shape[3]
    out, lse = forward_outputs(geo, None)
    if out.numel() == 0:
        return out, lse
    side = SideStream(q.device)  # forks here: the plan below runs while the window kernel does
    window_out, window_lse = hopper_window(geo, config)
    with side:
        plan = span_tile_plan(geo, SPAN_START_BLOCK)
    side.join(plan.order, plan.lo, plan.hi)
    hopper_span_tile_kernel[(triton.cdiv(plan.triples, TILE_ROWS), plan.groups)](
        q, *hopper_descriptors(k, geo.v, block_n, block_d(dim)), plan.order, plan.lo, plan.hi, window_out, window_lse,
        out, lse, q.stride(0), q.stride(1), q.stride(2), k.shape[1], q.shape[2], k.shape[2], plan.triples, geo.rep,
        LOG2E / math.sqrt(dim), K_SPANS=geo.qstart.shape[-1], D_HEAD=dim, BLOCK_D=block_d(dim), BLOCK_N=block_n,
        STAGES=config["span_stages"], PINGPONG=config["span_mma_turns"] == 2, num_warps=4,
    )
    return out, lse
