"""Span attention's forward for sm_90 in Gluon: window and span tiles fed by a TMA producer warp to
consumer warpgroups on wgmma, as in FlashAttention-3.

The numbers and plan of ``span_forward_tc`` (tile_forward.py): the window part of every query once,
then the spans in tiles of sorted (head, query, slot) triples, each row merged with its window part
by log-sum-exp. Both kernels attend a tile of ``BLOCK_M`` rows, each over its own key range [lo, hi]
of one KV group, through ``_attend_tile``: the key blocks of the tile's range [min lo, max hi] are

- loaded by a one-warp producer partition through the tensor memory accelerator into a ring of
  ``STAGES`` shared-memory K and V buffers (one mbarrier per buffer that its loads fill, one that
  the consumers free), the producer giving its registers to the consumers (24 each);
- computed by the consumer partition (``BLOCK_M / 16`` warps: one warpgroup per 64 rows): the
  scores of block j on the tensor cores while block j-1's probabilities meet its values, so the
  softmax of one block overlaps the other's matrix work; per-row [lo, hi] masks only on the blocks
  that not every row attends (the range's first and last).

Keys the last block loads past the range (up to ``BLOCK_N`` - 1 of them: later keys of the group,
which an unwritten static cache holds as NaN, or the next group's) get zero weight, and their
values are zeroed in shared memory before they meet the weights, so no key outside the range ever
reaches an output. Keys inside the range are attended by some row of the tile and are expected to
be finite: a NaN value there reaches the tile's other rows too, as 0 * NaN in the shared dot.
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

PRODUCER_REGISTERS = gl.constexpr(24)  # the producer warp only issues TMA loads and waits on barriers


@gluon.constexpr_function
def _mma_layout(cols, warps):
    """The wgmma accumulator layout of [rows, cols] tiles on ``warps`` warps stacked along the rows."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, cols, 16])


@gluon.constexpr_function
def _row_layout(warps):
    """A [rows, D] layout for pointer loads and shared-memory passes: 8 contiguous elements per thread."""
    return gl.BlockedLayout([1, 8], [4, 8], [warps, 1], [1, 0])


@gluon.jit
def _kv_producer(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, free, first_key_row, n_blocks,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Block j's K and V into buffer j % STAGES once the consumers have freed it."""
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
def _zero_values_past(v_buf, key0, tile_hi, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, WARPS: gl.constexpr):
    """Zero the rows of the value block of keys key0.. that lie past ``tile_hi``, for the wgmma that reads it next."""
    layout: gl.constexpr = _row_layout(WARPS)
    values = v_buf.load(layout)
    keys = key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    v_buf.store(gl.where(keys[:, None] <= tile_hi, values, gl.zeros_like(values)))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _tile_consumer(q_smem, k_bufs, v_bufs, k_ready, v_ready, free, row_lo, row_hi, tile_lo, tile_hi, n_blocks,
                   first_inner, end_inner, qk_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   BLOCK_D: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr):
    """(acc, m, l) of the tile's rows over its n_blocks key blocks: block j's scores are computed while
    block j-1's probabilities meet its values."""
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, WARPS)
    o_layout: gl.constexpr = _mma_layout(BLOCK_D, WARPS)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([BLOCK_M, BLOCK_D], gl.float32, o_layout)
    m = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    if n_blocks > 0:
        mbarrier.wait(k_ready.index(0), 0)
        s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        p, m, alpha, l = _block_probabilities(s, m, l, tile_lo, row_lo, row_hi, (first_inner > 0) | (end_inner < 1),
                                              qk_scale, BLOCK_N)
        for j in range(1, n_blocks):
            stage = j % STAGES
            prev = (j - 1) % STAGES
            mbarrier.wait(k_ready.index(stage), (j // STAGES) & 1)
            s = warpgroup_mma(q_smem, k_bufs.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
            p_op = gl.convert_layout(p.to(v_bufs.dtype), p_layout)
            acc = warpgroup_mma(p_op, v_bufs.index(prev), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s,))
            p, m, alpha, l = _block_probabilities(s, m, l, tile_lo + j * BLOCK_N, row_lo, row_hi,
                                                  (j < first_inner) | (j >= end_inner), qk_scale, BLOCK_N)
            acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
            mbarrier.arrive(free.index(prev), count=1)
            acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        last = (n_blocks - 1) % STAGES
        last_key0 = tile_lo + (n_blocks - 1) * BLOCK_N
        mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // STAGES) & 1)
        if last_key0 + BLOCK_N - 1 > tile_hi:
            _zero_values_past(v_bufs.index(last), last_key0, tile_hi, BLOCK_N, BLOCK_D, WARPS)
        p_op = gl.convert_layout(p.to(v_bufs.dtype), p_layout)
        acc = warpgroup_mma(p_op, v_bufs.index(last), acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
    return acc, gl.convert_layout(m, o_rows), gl.convert_layout(l, o_rows)


@gluon.jit
def _query_tile(Q_ptr, q_base, q_ok, D_HEAD: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr,
                WARPS: gl.constexpr):
    """The tile's query rows (element offsets ``q_base`` [BLOCK_M] in ``_row_layout``'s row slice,
    zeros where not ``q_ok``) gathered by pointer loads into the shared tile both dots read."""
    offs_d = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, _row_layout(WARPS)))
    q = gl.load(Q_ptr + q_base[:, None] + offs_d[None, :], mask=q_ok[:, None] & (offs_d[None, :] < D_HEAD), other=0.0)
    return gl.allocate_shared_memory(q.dtype, [BLOCK_M, BLOCK_D], gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_D], q.dtype), q)


@gluon.jit
def _attend_tile(q_smem, k_desc, v_desc, group_key_row, row_lo, row_hi, qk_scale, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr):
    """(acc, m, l) of each row r over keys [row_lo[r], row_hi[r]] of the group whose key 0 is
    descriptor row ``group_key_row`` (none when hi < lo: then (0, -inf, 0)), in the wgmma
    accumulator layout's rows, log2 domain, unnormalised."""
    present = row_hi >= row_lo
    tile_hi = gl.max(gl.where(present, row_hi, -1), axis=0)
    tile_lo = gl.minimum(gl.min(gl.where(present, row_lo, 2**30), axis=0), tile_hi + 1)
    n_blocks = gl.cdiv(tile_hi - tile_lo + 1, BLOCK_N)
    inner_lo = gl.max(gl.where(present, row_lo, -1), axis=0)
    inner_hi = gl.minimum(gl.min(gl.where(present, row_hi, 2**30), axis=0), tile_hi)
    first_inner = gl.minimum(gl.cdiv(gl.maximum(inner_lo - tile_lo, 0), BLOCK_N), n_blocks)
    end_inner = gl.maximum(gl.minimum((inner_hi - tile_lo + 1) // BLOCK_N, n_blocks), first_inner)

    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, BLOCK_D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, BLOCK_D], v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(free.index(i), count=1)
    fence_async_shared()

    acc, m, l = gl.warp_specialize([
        (_tile_consumer, (q_smem, k_bufs, v_bufs, k_ready, v_ready, free, row_lo, row_hi, tile_lo, tile_hi, n_blocks,
                          first_inner, end_inner, qk_scale, BLOCK_M, BLOCK_N, BLOCK_D, STAGES, WARPS)),
        (_kv_producer, (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, free, (group_key_row + tile_lo).to(gl.int32),
                        n_blocks, BLOCK_N, STAGES)),
    ], [1], [PRODUCER_REGISTERS])

    # Rows that attend no key come back as (0, -inf, 0), whatever the shared blocks held.
    present = gl.convert_layout(present, gl.SliceLayout(1, _mma_layout(BLOCK_D, WARPS)))
    return gl.where(present[:, None], acc, 0.0), gl.where(present, m, float("-inf")), gl.where(present, l, 0.0)


@gluon.jit
def hopper_window_kernel(
    Q_ptr, k_desc, v_desc, cache_pos_ptr, Ow_ptr, Lw_ptr, stride_qb, stride_qh, stride_ql, H_Q, L_Q, L_KV, REP, WINDOW,
    qk_scale, D_HEAD: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    """The window part of ``BLOCK_M`` consecutive queries of one head: normalised fp32 output and
    log2 LSE (``-inf`` where the row attends no key), as ``window_attention_kernel``."""
    head = gl.program_id(0).to(gl.int64)  # the heads of a KV group run one after another: their key blocks stay in L2
    tile = gl.program_id(1)
    batch = gl.program_id(2).to(gl.int64)
    s_rows: gl.constexpr = gl.SliceLayout(1, _mma_layout(BLOCK_N, num_warps))
    o_layout: gl.constexpr = _mma_layout(BLOCK_D, num_warps)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

    offs_m = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=s_rows)
    row_ok = offs_m < L_Q
    pos = gl.minimum(gl.load(cache_pos_ptr + offs_m, mask=row_ok, other=-1), L_KV - 1)
    row_lo = gl.maximum(pos - WINDOW + 1, 0)
    row_hi = gl.where(row_ok, pos, -1)

    offs_q = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, _row_layout(num_warps)))
    q_base = batch * stride_qb + head * stride_qh + offs_q.to(gl.int64) * stride_ql
    q_smem = _query_tile(Q_ptr, q_base, offs_q < L_Q, D_HEAD, BLOCK_M, BLOCK_D, num_warps)
    group_key_row = (batch * (H_Q // REP) + head // REP) * L_KV
    acc, m, l = _attend_tile(q_smem, k_desc, v_desc, group_key_row, row_lo, row_hi, qk_scale,
                             BLOCK_M, BLOCK_N, BLOCK_D, STAGES, num_warps)

    has_keys = (l > 0.0) | (l != l)  # noqa: PLR0124 - NaN must reach the output, not read as "no key"
    l_safe = gl.where(has_keys, l, 1.0)
    rows = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=o_rows)
    rows_ok = rows < L_Q
    out_rows = (batch * H_Q + head) * L_Q + rows
    cols = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, o_layout))
    out = gl.where(has_keys[:, None], acc / l_safe[:, None], 0.0)
    gl.store(Ow_ptr + out_rows[:, None] * D_HEAD + cols[None, :], out, mask=rows_ok[:, None] & (cols[None, :] < D_HEAD))
    gl.store(Lw_ptr + out_rows, gl.where(has_keys, m + gl.log2(l_safe), float("-inf")), mask=rows_ok)


@gluon.jit
def hopper_span_tile_kernel(
    Q_ptr, k_desc, v_desc, order_ptr, lo_ptr, hi_ptr, Ow_ptr, Lw_ptr, Out_ptr, Lse_ptr,
    stride_qb, stride_qh, stride_ql, H_KV, L_Q, L_KV, N_TRIPLES, REP, qk_scale,
    K_SPANS: gl.constexpr, D_HEAD: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    """One tile of ``BLOCK_M`` sorted (head, query, slot) triples of a KV group (``span_tile_plan``):
    each row's span part merged with its window part, written as ``span_tile_kernel`` writes it."""
    tile = gl.program_id(0)
    group = gl.program_id(1).to(gl.int64)
    batch = group // H_KV
    s_rows: gl.constexpr = gl.SliceLayout(1, _mma_layout(BLOCK_N, num_warps))
    o_layout: gl.constexpr = _mma_layout(BLOCK_D, num_warps)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

    offs_m = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=s_rows)
    row_ok = offs_m < N_TRIPLES
    plan = group * N_TRIPLES + offs_m
    row_lo = gl.load(lo_ptr + plan, mask=row_ok, other=0)
    row_hi = gl.load(hi_ptr + plan, mask=row_ok, other=-1)

    offs_q = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, _row_layout(num_warps)))
    q_ok = offs_q < N_TRIPLES
    triple = gl.load(order_ptr + group * N_TRIPLES + offs_q, mask=q_ok, other=0)
    head = (group % H_KV) * REP + triple // (L_Q * K_SPANS)
    query = (triple // K_SPANS) % L_Q
    q_smem = _query_tile(Q_ptr, batch * stride_qb + head * stride_qh + query * stride_ql, q_ok, D_HEAD, BLOCK_M,
                         BLOCK_D, num_warps)
    acc, m, l = _attend_tile(q_smem, k_desc, v_desc, group * L_KV, row_lo, row_hi, qk_scale,
                             BLOCK_M, BLOCK_N, BLOCK_D, STAGES, num_warps)

    rows = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=o_rows)
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
    normalised; lse2 [B, Hq, Lq] fp32), as ``window_attention``. ``config``: ``window_block_m``
    (64 or 128 queries), ``window_block_n`` and ``window_stages``. The caller has checked that K
    and V allow TMA (``row_descriptors``)."""
    q, k = geo.q, geo.k
    batch, hq, lq, dim = q.shape
    block_m, block_n = config["window_block_m"], config["window_block_n"]
    out = torch.empty(batch, hq, lq, dim, device=q.device, dtype=torch.float32)
    lse = torch.empty(batch, hq, lq, device=q.device, dtype=torch.float32)
    hopper_window_kernel[(hq, triton.cdiv(lq, block_m), batch)](
        q, *hopper_descriptors(k, geo.v, block_n, block_d(dim)), geo.cache_position, out, lse,
        q.stride(0), q.stride(1), q.stride(2), hq, lq, k.shape[2], geo.rep, geo.window, LOG2E / math.sqrt(dim),
        D_HEAD=dim, BLOCK_D=block_d(dim), BLOCK_M=block_m, BLOCK_N=block_n, STAGES=config["window_stages"],
        num_warps=block_m // 16,
    )
    return out, lse


def span_forward_hopper(geo: LaunchGeometry, config: Mapping[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The span forward with the Gluon kernels: (out [B, Hq, Lq, K, D] in Q's dtype, lse2 [B, Hq, Lq,
    K] fp32), the numbers of ``tile_forward.span_forward_tc``. ``config``: ``window_block_m``,
    ``window_block_n``, ``window_stages`` (``hopper_window``) and ``span_block_m`` (64 or 128 rows,
    a consumer warpgroup per 64), ``span_block_n`` and ``span_stages`` (K/V buffers). The caller
    has checked the variant's conditions (an sm_90 GPU, 16-bit inputs, no mask) and that K and V
    allow TMA (``tma_readable``)."""
    q, k = geo.q, geo.k
    block_m, block_n, dim = config["span_block_m"], config["span_block_n"], q.shape[3]
    out, lse = forward_outputs(geo, None)
    if out.numel() == 0:
        return out, lse
    side = SideStream(q.device)  # forks here: the plan below runs while the window kernel does
    window_out, window_lse = hopper_window(geo, config)
    with side:
        plan = span_tile_plan(geo, SPAN_START_BLOCK)
    side.join(plan.order, plan.lo, plan.hi)
    hopper_span_tile_kernel[(triton.cdiv(plan.triples, block_m), plan.groups)](
        q, *hopper_descriptors(k, geo.v, block_n, block_d(dim)), plan.order, plan.lo, plan.hi, window_out, window_lse,
        out, lse, q.stride(0), q.stride(1), q.stride(2), k.shape[1], q.shape[2], k.shape[2], plan.triples, geo.rep,
        LOG2E / math.sqrt(dim), K_SPANS=geo.qstart.shape[-1], D_HEAD=dim, BLOCK_D=block_d(dim), BLOCK_M=block_m,
        BLOCK_N=block_n, STAGES=config["span_stages"], num_warps=block_m // 16,
    )
    return out, lse
