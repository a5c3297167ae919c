"""Mutation check: plant one bug at a time in a temporary copy of the repository and run the tests
that must catch it. The working checkout is never modified.

    python scripts/plant_bugs.py [--only SUBSTRING] [--keep]

A plant counts as CAUGHT only when pytest exits 1 with failed tests whose first error is an
AssertionError (a test's check failed); a collection or usage error (exit 2-5), a crash of the
test itself, or a plant whose text is no longer in the source (STALE) counts as not caught. Exit status 0 only when every plant is caught.
The store plants' tests need a PostgreSQL server, as in CI (source ci/postgres.sh && postgres_start): without
one they skip, and those plants count as not caught. The Hopper tiles' plants need an sm_90 GPU
(``--only hopper`` there); elsewhere their tests skip and they count as not caught.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
F = "superlinear_ops/ops/span_attention/per_query_forward.py"
B = "superlinear_ops/ops/span_attention/per_query_backward.py"
C = "superlinear_ops/ops/kernel_helpers.py"
DEC = "superlinear_ops/ops/staged_decode/staged.py"
GATE = "superlinear_ops/ops/staged_decode/gate_step.py"
G = "superlinear_ops/ops/staged_decode/grouped_kernels.py"
GA = "superlinear_ops/ops/staged_decode/group_attend.py"
GST = "superlinear_ops/ops/staged_decode/group_stage.py"
DV = "superlinear_ops/ops/staged_decode/variants.py"
SS = "superlinear_ops/ops/staged_decode/stripe_spans_kernels.py"
GS = "superlinear_ops/ops/staged_decode/group_spans_kernels.py"
OL = "superlinear_ops/ops/staged_decode/split_keys_kernels.py"
S = "superlinear_ops/ops/staged_decode/stripe_search_kernel.py"
SPLIT = "superlinear_ops/ops/staged_decode/split_window_kernels.py"
TCF = "superlinear_ops/ops/span_attention/tile_forward.py"
WIN = "superlinear_ops/ops/span_attention/window_forward.py"
SAN = "superlinear_ops/tuner/sanitize.py"
TILES = "superlinear_ops/ops/span_attention/span_tiles.py"
TCB = "superlinear_ops/ops/span_attention/tile_backward.py"
GEO = "superlinear_ops/geometry.py"
REF = "superlinear_ops/ops/span_attention/reference.py"
VARIANTS = "tests/ops/test_variants.py"
LSK = "superlinear_ops/ops/layer_search/tiled_search.py"
LSR = "superlinear_ops/ops/layer_search/reference.py"
STS = "superlinear_ops/ops/layer_search/stripe_tile_search.py"
TUNE = "superlinear_ops/tuner/tune.py"
SEARCH = "superlinear_ops/tuner/search.py"
SHAPES = "tests/ops/layer_search/test_search_shapes.py"
EDGES = "tests/ops/layer_search/test_search_tile_edges.py"
BLOCKS = "tests/ops/span_attention/test_reference_blocks.py"
ANCHOR_SPANS = "superlinear_ops/ops/layer/spans.py"
LCOMP = "superlinear_ops/ops/layer/composition.py"
LGL = "superlinear_ops/ops/gate/launchers.py"
LGK = "superlinear_ops/ops/gate/kernels.py"
LGO = "superlinear_ops/ops/gate/__init__.py"
LAYER = "tests/ops/layer/test_whole_layer.py"
GATES = "tests/ops/gate/test_gate_ops.py"
FWD = f"{VARIANTS} -k span_forward"
LAUNCH = "superlinear_ops/launch.py"
WTB = "superlinear_ops/ops/span_attention/window_backward.py"
WFULL = "tests/ops/span_attention/test_tile_backward.py -k full_tiles"
WTABLES = "tests/ops/span_attention/test_tile_backward.py -k window_tables"
API = "superlinear_ops/api.py"
HAPI = "tests/api/test_bad_input.py"
SETTINGS = "superlinear_ops/settings.py"
TORCH_OPS = "superlinear_ops/torch_ops.py"
INPUTS = "tests/api/test_extreme_inputs.py"
BWD = f"{VARIANTS} -k span_backward"
TCF_TESTS = "tests/ops/span_attention/test_tile_forward.py"
HOP = "superlinear_ops/ops/span_attention/hopper_tile_forward.py"
HOP_TESTS = "tests/ops/span_attention/test_hopper_tile_forward.py"
LSP = "superlinear_ops/ops/layer/spans_kernel.py"
SPANS = "tests/ops/layer/test_layer_spans.py"


def decode(variant: str) -> str:
    return f"{VARIANTS} -k 'decode and {variant}'"


# name: (file, text, replacement, tests that must catch it)
PLANTS = {
    "forward drops first window key": (C, "lo = tl.maximum(pos - WINDOW + 1, 0)", "lo = tl.maximum(pos - WINDOW + 2, 0)", FWD),
    "forward query row stride replaced by D": (F, "query * stride_ql + offs_d", "query * D_HEAD + offs_d", FWD),
    "per-span dQ scaled": (B, "tl.atomic_add(dq_ptrs, dq * sm_scale, mask=d_mask,", "tl.atomic_add(dq_ptrs, dq * sm_scale * 1.01, mask=d_mask,", f"{VARIANTS} -k 'span_backward and per_span'"),
    "fused dQ scaled": (B, "tl.store(dq_ptrs, dq * sm_scale, mask=d_mask)", "tl.store(dq_ptrs, dq * sm_scale * 1.01, mask=d_mask)", f"{VARIANTS} -k 'span_backward and fused'"),
    "shared dK/dV wrong kv head": (B, "dkv_base = (batch * (H_Q // REP) + kv_head) * L_KV * D_HEAD", "dkv_base = (batch * (H_Q // REP) + (kv_head + 1) % (H_Q // REP)) * L_KV * D_HEAD", f"{VARIANTS} -k 'span_backward and shared'"),
    "split dK/dV wrong q head": (B, "dkv_base = (batch * H_Q + head) * L_KV * D_HEAD", "dkv_base = (batch * H_Q + (head + 1) % H_Q) * L_KV * D_HEAD", f"{VARIANTS} -k 'span_backward and split'"),
    "fused window misses last span's dV": (B, "dv += tl.where(live, p[:, None] * do[None, :], 0.0)", "dv += tl.where(live, p[:, None] * do[None, :], 0.0) * (j < N_SLOTS - 1 or N_SLOTS == 1)", f"{VARIANTS} -k 'span_backward and fused'"),
    "backward window limited to its first key block": (B, "    lo, hi = window_bounds(pos, WINDOW)\n    dq = _backward_segment(", "    lo, hi = window_bounds(pos, WINDOW)\n    hi = tl.minimum(hi, lo + BLOCK_K - 1)\n    dq = _backward_segment(", BWD),
    "decode gate halves scores": (GATE, "gate = torch.softmax(torch.where(any_chosen, scores, torch.zeros_like(scores)), dim=-1)", "gate = torch.softmax(torch.where(any_chosen, scores, torch.zeros_like(scores)) / 2, dim=-1)", decode("staged")),
    "decode span start off by one": (DEC, "(anchor - back_len).clamp(min=0)", "(anchor - back_len + 1).clamp(min=0)", decode("staged")),
    "staged stripe validity ignores the mask": (DEC, "valid = valid & (attention_mask[:, safe_loc] != 0)", "valid = valid", decode("staged")),
    "stripe search span start off by one": (S, "tl.maximum(anchor - back, 0)", "tl.maximum(anchor - back + 1, 0)", decode("split_window")),
    "stripe search top-k takes the lowest score": (S, "best = tl.max(scores, axis=0)", "best = tl.min(tl.where(scores > float('-inf'), scores, float('inf')), axis=0)", decode("split_window")),
    "split decode drops the last chunk": (SPLIT, "for chunk in range(0, N_CHUNKS):", "for chunk in range(0, N_CHUNKS - 1):", decode("split_window")),
    "split decode gate ignores scores": (SPLIT, "weight = tl.where(any_chosen, tl.exp(tl.load(score_ptr + row * K_SPANS + j) - top), 1.0) / total", "weight = 1.0 / K_SPANS", decode("split_window")),
    "grouped search scores halved": (GST, "scores = tc_dot(queries, tl.trans(keys), UPCAST)", "scores = tc_dot(queries, tl.trans(keys), UPCAST) * 0.5", decode("grouped")),
    "grouped candidate merge shifts slots": (GA, "score = tl.where(slot == j, best, score)", "score = tl.where(slot == (j + 1) % TOPK, best, score)", decode("grouped")),
    "grouped window chunk drops a key": (GST, "hi = tl.minimum(window_hi, lo + WCHUNK - 1)", "hi = tl.minimum(window_hi, lo + WCHUNK - 2)", decode("grouped")),
    "grouped merge halves the window": (GA, "l = w_l * a_w + s_l * a_s", "l = w_l * a_w * 0.5 + s_l * a_s", decode("grouped")),
    "grouped merge runs before the last chunk": (G, "if finished == TOPK * N_CHUNKS - 1:", "if finished == 0:", decode("grouped")),
    "grouped first allowed key ignored": (G, "                    forward = tl.load(forward_ptr + t - first)  # first < window start < t\n", "                    forward = forward\n", decode("grouped")),
    "grouped ties go to the farther anchor": (GA, "pick = tl.max(tl.where(scores == best, anchors, NO_ANCHOR), axis=0)", "pick = tl.min(tl.where(scores == best, anchors, 2**30), axis=0)", "tests/ops/staged_decode/test_decode.py -k 'tied and grouped'"),
    "grouped search keeps masked stripes": (GST, "        valid = valid & (tl.load(mask_ptr + batch * stride_mb + loc, mask=valid, other=0) != 0)\n", "        valid = valid\n", decode("grouped")),
    "grouped TMA: a last block keeps the keys past its span": (GA, "whole_end + offs <= hi,", "whole_end + offs <= hi + BLOCK_K,", decode("grouped")),
    "grouped TMA: values past the span not zeroed": (GA, "whole_end + offs <= hi, qk_scale, BLOCK_K, False, True, True, UPCAST)", "whole_end + offs <= hi, qk_scale, BLOCK_K, False, True, False, UPCAST)", "tests/ops/staged_decode/test_decode.py -k nan_in_keys_nobody"),
    "TMA mask: the first block's mask ignored": (GA, "keep = allowed_keys(mask_row_ptr, lo, hi, offs)", "keep = lo + offs <= hi", "tests/ops/staged_decode/test_decode_mask.py"),
    "TMA mask: later blocks' masks ignored": (GA, "keep_ahead = allowed_keys(mask_row_ptr, start + BLOCK_K, hi, offs)", "keep_ahead = start + BLOCK_K + offs <= hi", "tests/ops/staged_decode/test_decode_mask.py"),
    "TMA mask: every block takes the first block's mask": (GA, "            keep = keep_ahead\n", "            keep = keep | (keep_ahead & False)\n", "tests/ops/staged_decode/test_decode_mask.py"),
    "TMA mask: the mask read ahead is the current block's": (GA, "allowed_keys(mask_row_ptr, start + BLOCK_K,", "allowed_keys(mask_row_ptr, start,", "tests/ops/staged_decode/test_decode_mask.py"),
    "TMA mask: batch row 0's mask for every row": (GA, "desc_row, lo, hi, mask_ptr + mask_base, qk_scale,\n                                      BLOCK_K, HAS_MASK, False, UPCAST)", "desc_row, lo, hi, mask_ptr, qk_scale,\n                                      BLOCK_K, HAS_MASK, False, UPCAST)", "tests/ops/staged_decode/test_decode_mask.py"),
    "TMA mask: the second pass keeps the hidden values": (GA, "BLOCK_K, True, True, UPCAST)", "BLOCK_K, True, False, UPCAST)", "tests/ops/staged_decode/test_decode_mask.py -k never_show"),
    "TMA mask: no second pass": (GA, "if holds_nan(acc):  # a zero weight", "if holds_nan(acc) & False:  # a zero weight", "tests/ops/staged_decode/test_decode_mask.py -k never_show"),
    "group_spans: candidate merge shifts slots": (GS, "score = tl.where(row_slot == j, tl.max(", "score = tl.where(row_slot == (j + 1) % TOPK, tl.max(", decode("group_spans")),
    "row-tile decodes: spans start one key late": (GA, "lo = tl.maximum(anchor - tl.load(back_ptr + t), 0)\n    hi = anchor.to(tl.int64)", "lo = tl.maximum(anchor - tl.load(back_ptr + t), 0) + 1\n    hi = anchor.to(tl.int64)", decode("group_spans or one_launch")),
    "group_spans: a chunk drops its last key": (GS, "row_hi = tl.minimum(hi, chunk * CHUNK + CHUNK - 1)", "row_hi = tl.minimum(hi, chunk * CHUNK + CHUNK - 2)", "tests/ops/staged_decode/test_decode.py -k 'chunks and group_spans'"),
    "group_spans: partial stored one place late": (GS, "* N_PLACES + chunk - lo // CHUNK", "* N_PLACES + chunk - lo // CHUNK + (chunk > 0)", "tests/ops/staged_decode/test_decode.py -k 'chunks and group_spans'"),
    "group_spans: the merge counts one chunk too few per span": (GS, "places = tl.where(lo <= hi, hi // CHUNK - lo // CHUNK + 1, 0)", "places = tl.where(lo <= hi, hi // CHUNK - lo // CHUNK, 0)", "tests/ops/staged_decode/test_decode.py -k 'chunks and group_spans'"),
    "group_spans: the merge reads the next group's candidates": (GS, "slots * 0 + head % REP, slots, head // REP,", "slots * 0 + head % REP, slots, head // REP + 1,", decode("group_spans")),
    "group_spans: no clean second pass": (GS, "if holds_nan(acc):  # a zero weight times", "if holds_nan(acc) & False:  # a zero weight times", "tests/ops/staged_decode/test_decode.py -k row_tiles_keep"),
    "group_spans: an attended infinite value read as 0": (GS, 'acc = tl.where(bad[:, None], float("nan"), acc)', "acc = acc", "tests/ops/staged_decode/test_decode.py -k row_tiles_keep"),
    "row-tile decodes: first allowed key ignored": (GA, "from_key = tl.where((first > 0) & (first < L_KV), first, 0)", "from_key = 0", "tests/ops/staged_decode/test_decode_mask.py -k group_spans"),
    "group_spans: the mask ignored": (GS, "HAS_MASK, False, UPCAST)", "False, False, UPCAST)", "tests/ops/staged_decode/test_decode_mask.py -k group_spans"),
    "group_spans: a program walks only its first chunk": (GS, "for chunk in range(tl.program_id(0), N_KEY_CHUNKS, tl.num_programs(0)):", "for chunk in range(tl.program_id(0), tl.program_id(0) + 1):", "tests/ops/staged_decode/test_decode.py -k walk"),
    "group_spans: the second pass ignores the mask": (GS, "MIN_DOT, HAS_MASK,", "MIN_DOT, False,", "tests/ops/staged_decode/test_decode_mask.py -k group_spans"),
    "one_launch: the first program to finish merges": (OL, "== splits - 1:", "== 0:", "tests/ops/staged_decode/test_split_keys.py -k 'splits and one_launch'"),
    "one_launch: a split drops its last key": (OL, "row_hi = tl.minimum(hi, split * CHUNK + CHUNK - 1)", "row_hi = tl.minimum(hi, split * CHUNK + CHUNK - 2)", "tests/ops/staged_decode/test_split_keys.py -k 'splits and one_launch'"),
    "one_launch: the running top-k forgets earlier stripe blocks": (OL, "top = tl.maximum(tl.max(best, axis=1), tl.max(scores, axis=1))", "top = tl.max(scores, axis=1)", "tests/ops/staged_decode/test_split_keys.py -k earlier_block"),
    "one_launch: the window ends a key early": (OL, "hi = tl.where(row_slot == TOPK, window_hi, ", "hi = tl.where(row_slot == TOPK, window_hi - 1, ", decode("one_launch")),
    "one_launch: first allowed key not searched": (OL, "first = _first_allowed(mask_row_ptr, 0, window_lo, L_KV, 256)", "first = _first_allowed(mask_row_ptr, 0, window_lo, L_KV, 256) * 0", "tests/ops/staged_decode/test_split_keys.py -k first_allowed"),
    "one_launch: a head that chose no span gets no output": (OL, "tl.exp(scores - tl.where(any_chosen, top, 0.0)[None, :]), 1.0)", "tl.exp(scores - tl.where(any_chosen, top, 0.0)[None, :]), 0.0)", decode("one_launch")),
    "one_launch: spans merged without their window": (OL, "weighted = acc3 * a_span[:, :, None] + w_acc[None, :, :] * a_window[:, :, None]", "weighted = acc3 * a_span[:, :, None]", decode("one_launch")),
    "one_launch: the merge drops the first split": (OL, 'held = part_m != float("-inf")', 'held = (part_m != float("-inf")) & (other > 0)', "tests/ops/staged_decode/test_split_keys.py -k 'splits and one_launch'"),
    "one_launch: the windows' partials not stored": (OL, 'mask=(m != float("-inf"))[:, None]', 'mask=(m != float("-inf"))[:, None] & (rows < TOPK * REP_PAD)[:, None]', "tests/ops/staged_decode/test_split_keys.py -k 'splits and one_launch'"),
    "one_launch: a hidden stripe searched": (OL, "valid = valid & (tl.load(mask_row_ptr + loc, mask=valid, other=0) != 0)", "valid = valid", decode("one_launch")),
    "split_merge: the window merged without its last split": (OL, "counts, SPLITS, TOPK, TOPK_POW2", "counts, SPLITS - 1, TOPK, TOPK_POW2", "tests/ops/staged_decode/test_split_keys.py -k 'splits and split_merge'"),
    "split_merge: span partials stored under each other's slots": (OL, "span_part = (head_row * TOPK + row_slot) * splits + split", "span_part = (head_row * TOPK + (TOPK - 1 - row_slot)) * splits + split", decode("split_merge")),
    "grouped: a chunk reaching past its anchor skips the first allowed key": (G, "if lo + chunk * CHUNK + CHUNK - 1 > anchor:", "if lo + chunk * CHUNK > anchor:", "tests/ops/staged_decode/test_decode_mask.py -k grouped"),
    "stripe_spans: a chunk reaching past its anchor skips the first allowed key": (GST, "            if hi > loc:\n", "            if hi > loc + 1000:\n", "tests/ops/staged_decode/test_decode_mask.py -k stripe_spans"),
    "grouped: a first allowed key of 1 read as key 0": (G, "if (first > 0) & (first < L_KV):\n                    forward = tl.load", "if (first > 1) & (first < L_KV):\n                    forward = tl.load", "tests/ops/staged_decode/test_decode_mask.py -k 'key_0_alone and grouped'"),
    "stripe_spans: a first allowed key of 1 read as key 0": (GST, "if (first > 0) & (first < L_KV):\n                    hi = tl.minimum", "if (first > 1) & (first < L_KV):\n                    hi = tl.minimum", "tests/ops/staged_decode/test_decode_mask.py -k 'key_0_alone and stripe_spans'"),
    "tuner: only the problem's default queued": (SEARCH, "earlier, sibling, *variant_default_params(problem, list(variants.values()))):", "earlier, sibling):", "tests/tuner/test_tuner.py -k short_search"),
    "tuner: queued trials past the trial budget": (SEARCH, "for t in trials) >= room:", "for t in trials) >= room + 9:", "tests/tuner/test_tuner.py -k short_search"),
    "tuner: an interrupted trial counts against the budget": (SEARCH, "if not {REFUSED, INTERRUPTED} & set(t.user_attrs)]", "if REFUSED not in t.user_attrs]", "tests/tuner/test_tuner_stress.py -k ctrl_c"),
    "tuner: the winner stored before recorded again on resume": (SEARCH, "if EARLIER not in study.user_attrs and not study.get_trials(deepcopy=False):", "if True:", "tests/tuner/test_tuner.py -k recorded_once"),
    "stripe_spans: the mask head read as allowing every key": (GST, "head_allowed = in_head & (tl.load(mask_row + head, mask=in_head, other=0) != 0)", "head_allowed = in_head", "tests/ops/staged_decode/test_decode_mask.py -k stripe_spans"),
    "stripe_spans: the forward length of the key after the first allowed one": (GST, "reach = tl.sum(tl.where(head == first, head_forward, 0), axis=0)", "reach = tl.sum(tl.where(head == first + 1, head_forward, 0), axis=0)", "tests/ops/staged_decode/test_decode.py -k 'first_allowed and stripe_spans'"),
    "stripe_spans: the forward length past the mask head counted from one key later": (GST, "reach = tl.load(forward_ptr + t - first, mask=first < L_KV, other=0)", "reach = tl.load(forward_ptr + t - first - 1, mask=first < L_KV, other=0)", "tests/ops/staged_decode/test_decode.py -k 'first_allowed and stripe_spans'"),
    "stripe_spans: masked window blocks through TMA without the mask": (GST, "REP_PAD, D_HEAD, BLOCK_D, block, HAS_MASK, KV_TMA, UPCAST)", "REP_PAD, D_HEAD, BLOCK_D, block, False, KV_TMA, UPCAST)", "tests/ops/staged_decode/test_decode_mask.py -k stripe_spans"),
    "stripe_spans: masked window blocks through TMA from the rows of batch row 0, KV head 0": (GST, "keys_per_head = L_KV if KV_TMA else 0", "keys_per_head = 0", "tests/ops/staged_decode/test_decode_mask.py -k stripe_spans"),
    "stripe_spans: span chunks attended without the mask": (GST, "REP, qk_scale, REP_PAD, D_HEAD, BLOCK_D, BLOCK_K, HAS_MASK, KV_TMA, UPCAST)", "REP, qk_scale, REP_PAD, D_HEAD, BLOCK_D, BLOCK_K, False, KV_TMA, UPCAST)", "tests/ops/staged_decode/test_decode_mask.py -k stripe_spans"),
    "grouped pointer loads: hidden keys read": (GA, "mask_base, lo, hi, offs_d, d_mask,\n                            qk_scale, BLOCK_K, HAS_MASK, UPCAST)", "mask_base, lo, hi, offs_d, d_mask,\n                            qk_scale, BLOCK_K, False, UPCAST)", "tests/ops/staged_decode/test_decode_mask.py -k pointer_loads"),
    "grouped pointer loads: spans skip their first key": (GA, "mask_base, lo, hi, offs_d, d_mask,\n                            qk_scale, BLOCK_K, HAS_MASK, UPCAST)", "mask_base, lo + 1, hi, offs_d, d_mask,\n                            qk_scale, BLOCK_K, HAS_MASK, UPCAST)", "tests/ops/staged_decode/test_decode_mask.py -k pointer_loads"),
    "grouped span starts one key early": (G, "back = tl.load(back_ptr + t)", "back = tl.load(back_ptr + t) + 1", decode("grouped")),
    "grouped partials stored in program order": (G, "part = (batch * H_Q * TOPK + head_slot) * N_CHUNKS + chunk + rows * 0", "part = batch * H_Q * TOPK * N_CHUNKS + pid + rows * 0", "tests/ops/staged_decode/test_decode.py -k several_chunks"),
    "grouped bf16 output scaled by 1.01": (G, "        launch_pdl=g.pdl,\n    )\n    return g.out\n", "        launch_pdl=g.pdl,\n    )\n    return g.out * 1.01 if q2.dtype == torch.bfloat16 else g.out\n", decode("grouped")),
    "geometry stripe_count drops the last stripe": (GEO, "return max(largest, sw_index + 1)", "return max(largest - 1, sw_index + 1)", f"{VARIANTS}::test_decode_variant_matches_oracle tests/base/test_geometry.py"),
    "tensor-core forward: window part dropped in the merge": (TCF, "        beta = tl.exp2(lw - m_ref)\n", "        beta = tl.exp2(lw - m_ref) * 0.0\n", f"{FWD} -k tc_tiles"),
    "tensor-core forward: window starts one key late": (WIN, "    row_lo = tl.maximum(pos - WINDOW + 1, 0)\n", "    row_lo = tl.maximum(pos - WINDOW + 2, 0)\n", f"{FWD} -k tc_tiles"),
    "tensor-core backward: span dV scaled by 1.01": (TCB, "        dv = tc_dot(tl.trans(operand(p, do, UPCAST)), do, UPCAST)\n", "        dv = tc_dot(tl.trans(operand(p, do, UPCAST)), do, UPCAST) * 1.01\n", f"{BWD} -k tc_tiles"),
    "tensor-core backward: span dQ dropped": (TCB, "dq * sm_scale, mask=dq_mask", "dq * sm_scale * 0.0, mask=dq_mask", f"{BWD} -k tc_tiles"),
    "tensor-core backward: window dO* of the combined row scaled by 1.01": (TCB, "        dos += tl.where(w[:, None] > 0.0, w[:, None] * do, 0.0)\n", "        dos += tl.where(w[:, None] > 0.0, w[:, None] * do * 1.01, 0.0)\n", f"{BWD} -k tc_tiles"),
    "layer search ties: the nearer stripe wins": (LSK, "& ((score >= worst) & ok)[:, None]", "& ((score > worst) & ok)[:, None]", LAYER),
    "layer search drops the stripe at key 0": (LSK, "below = tl.load(offsets_ptr + mid, mask=open_, other=0) <= pos + 1", "below = tl.load(offsets_ptr + mid, mask=open_, other=0) < pos + 1", LAYER),
    "layer search tables read strided positions as contiguous": (LSK, "cache_position.contiguous(), offsets, positions", "cache_position, offsets, positions", f"{LAYER} -k strided"),
    "layer search positions not clamped to the keys": (LSK, "pos = tl.minimum(tl.maximum(pos, -1), L_KV - 1)", "pos = tl.maximum(pos, -1)", LAYER),
    "layer search stores its scores 1% high": (LSK, "tl.where(found, best, EMPTY_SCORE)", "tl.where(found, best * 1.01, EMPTY_SCORE)", LAYER),
    "stripe-tile search stores its scores 1% high": (STS, "tl.where(found, best, EMPTY_SCORE)", "tl.where(found, best * 1.01, EMPTY_SCORE)", LAYER),
    "layer reference search: each slot gets its neighbour's score": (LSR, "scores_kept.append(torch.where(kept, best, torch.full_like(best, EMPTY_SCORE)))", "scores_kept.append(torch.where(kept, best.roll(1, -1), torch.full_like(best, EMPTY_SCORE)))", LAYER),
    "layer takes the search scores although Q1 needs a gradient": ("superlinear_ops/ops/layer/composition.py", "if search_scores is not None and not requires_grad(q1, k):", "if search_scores is not None:", LAYER),
    "layer recomputes the gate scores in a forward": ("superlinear_ops/ops/layer/composition.py", "if search_scores is not None and not requires_grad(q1, k):", "if False:", LAYER),
    "layer search ignores the mask": (LSK, "valid = valid & (tl.load(mask_ptr + mask_base + loc, mask=valid, other=0) != 0)", "valid = valid", LAYER),
    "layer search keeps the first slot only": (LSK, "take = is_worst & (best_key == worst_key[:, None])", "take = is_worst & (slot == 0)", LAYER),
    "stripe-tile search ties across tiles: the nearer stripe wins": (STS, "go = present & (top >= worst)\n", "go = present & (top > worst)\n", f"{SHAPES} -k merges"),
    "stripe-tile search ties within a tile: the nearer stripe wins": (STS, "beats = go & ((top > worst) | (top_j > worst_j))", "beats = go & (top > worst)", f"{SHAPES} -k merges"),
    "layer search: an empty slot's anchor is key 0": (LSK, "tl.where(found, best_key, -1).to(tl.int64)", "tl.where(found, best_key, 0).to(tl.int64)", f"{SHAPES} -k fewer"),
    "stripe-tile search: batch row 0's mask for every row": (STS, "    mask_base = batch * stride_mb\n", "    mask_base = batch * 0\n", f"{SHAPES} -k fewer"),
    "layer search: batch row 0's mask for every row": (LSK, "    mask_base = batch * stride_mb\n", "    mask_base = batch * 0\n", f"{SHAPES} -k fewer"),
    "public decode: sw_index and topk swap places": (API, "    sw_index: int = 0,\n    topk: int = 3,\n    enable_gqa: bool = True,", "    topk: int = 3,\n    sw_index: int = 0,\n    enable_gqa: bool = True,", "tests/api/test_patch.py -k binds"),
    "public decode: span_power defaults to 0.55": (API, "    span_power: float = 0.5,\n    search_power: float | None = None,\n    inv_search_power_int: int | None = 2,\n    force_mode", "    span_power: float = 0.55,\n    search_power: float | None = None,\n    inv_search_power_int: int | None = 2,\n    force_mode", "tests/api/test_patch.py -k binds"),
    "stripe-tile search takes one candidate per tile": (STS, "go = beats & present & (top >= worst)", "go = beats & present & (top != top)", f"{LAYER} {SHAPES}"),
    "stripe-tile search scores a neighbour query's keys": (STS, "own_query = (rows // BLOCK_H)[:, None] == (cols // BLOCK_S)[None, :]", "own_query = (rows // BLOCK_H)[:, None] >= 0", LAYER),
    "stripe-tile search ignores the mask": (STS, "valid = valid & (tl.load(mask_ptr + mask_base + loc, mask=valid, other=0) != 0)", "valid = valid", LAYER),
    "stripe-tile search skips a tile's first stripe": (STS, "    j = j0 + offs_s\n", "    j = j0 + offs_s + (offs_s == 0).to(tl.int32)\n", f"{SHAPES} -k merges"),
    "stripe-tile search prefetches half a tile ahead": (STS, "j0 + BLOCK_S, N_STRIPES, t_c, n_c", "j0 + BLOCK_S // 2, N_STRIPES, t_c, n_c", f"{SHAPES} -k merges"),
    "stripe-tile search: an empty slot gives anchor 0": (STS, "anchors = tl.where(found, t_r[:, None] - offset, -1)", "anchors = tl.where(found, t_r[:, None] - offset, 0)", LAYER),
    "tuner stores a winner the confirmation found slower": (TUNE, 'if confirmed["median_ms"] < confirmed["default_ms"] * (1.0 - margin):', "if True:", "tests/tuner/test_tuner.py -k winner_is_stored"),
    "tuner: the winner stored before needs the margin too": (TUNE, 'confirmed["params"] in (study.user_attrs.get(EARLIER), study.user_attrs.get(SIBLING))', 'confirmed["params"] == study.user_attrs.get(SIBLING)', "tests/tuner/test_tuner.py -k winner_is_stored"),
    "tuner: the winner stored before is not recorded on the study": (SEARCH, "study.set_user_attr(EARLIER, earlier)  #", "study.set_user_attr(EARLIER, None)  #", "tests/tuner/test_tuner.py -k retune"),
    "layer reference search ties: the nearer stripe wins": (LSR, "order = torch.sort(scores.flip(-1), dim=-1, descending=True, stable=True).indices[..., : settings.topk]\n        best = torch.gather(scores.flip(-1), -1, order)\n        stripe = n_stripes - 1 - order", "order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., : settings.topk]\n        best = torch.gather(scores, -1, order)\n        stripe = order", LAYER),
    "layer reference search drops the stripe at key 0": (LSR, "valid = (loc >= 0).expand(", "valid = (loc > 0).expand(", LAYER),
    "layer gate: empty slots score +1e9": (LGO, "EMPTY_SCORE = -1e9", "EMPTY_SCORE = 1e9", LAYER),
    "layer gate kernels ignore the configured BLOCK_R": (LGK, "BLOCK_R=config.block_r,", "BLOCK_R=16,", GATES),
    "layer gate dispatch ignores the tuned configuration": (TORCH_OPS, "return selected.variant, selected.config", "return selected.variant, selected.variant.default(REGISTRY.spec(op).problem_of(*call))", GATES),
    "layer gate ignores an explicit choice": (LCOMP, "gate_variant.launch(scores, span_out, dtype, gate_config)", "gate_variant.launch(scores, span_out, dtype, gate_variant.default(None))", GATES),
    "layer gate (PyTorch path) softmax over the queries": (LGL, "gate = torch.softmax(scores, dim=-1)\n    return (gate", "gate = torch.softmax(scores, dim=2)\n    return (gate", LAYER),
    "layer gate (PyTorch path) backward drops the mean score": (LGL, "d_scores = gate * (s - (gate * s).sum(dim=-1, keepdim=True))", "d_scores = gate * s", LAYER),
    "layer gate kernel weights do not sum to 1": (LGK, "return e / tl.sum(e, axis=1)[:, None]", "return e / (tl.sum(e, axis=1)[:, None] + 0.01)", LAYER),
    "layer gate kernel backward drops the mean score": (LGK, "d_v = g * (s - tl.sum(g * s, axis=1)[:, None])", "d_v = g * s", LAYER),
    "layer gate kernel backward leaves dO_j unweighted": (LGK, "(_slot(g, j, TOPK_PAD)[:, None] * d_out).to(", "(d_out).to(", LAYER),
    "layer gate-score kernel gives K no gradient": (LGK, "tl.atomic_add(dK_ptr + key_rows[:, None] * D_HEAD + offs_d[None, :], d_score[:, None] * q1, mask=rd_used,\n                      sem=\"relaxed\")", "pass", LAYER),
    "layer gate-score kernel dK lands on the next key": (LGK, "key_rows = (batch * H_KV + kv_head) * L_KV + anchor", "key_rows = (batch * H_KV + kv_head) * L_KV + (anchor + 1) % L_KV", LAYER),
    "layer gate-score kernel scores scaled by 1/sqrt(D)": (LGK, "score = tl.where(used, tl.sum(q1 * keys, axis=1), EMPTY_SCORE)", "score = tl.where(used, tl.sum(q1 * keys, axis=1) / 11.3, EMPTY_SCORE)", LAYER),
    "layer gate-score kernel dQ1 scaled by 1.01": (LGK, "d_q1 += d_score[:, None] * keys.to(tl.float32)", "d_q1 += 1.01 * d_score[:, None] * keys.to(tl.float32)", LAYER),
    "layer gate scores (PyTorch path) scaled by 1/sqrt(D)": (LGL, "scores = (keys.to(cdt) * q1.to(cdt)[..., None, :]).sum(dim=-1)", "scores = (keys.to(cdt) * q1.to(cdt)[..., None, :]).sum(dim=-1) / q1.shape[-1] ** 0.5", LAYER),
    "layer gate scores (PyTorch path) dK lands on the next key": (LGL, "d_k.index_add_(0, rows.reshape(-1),", "d_k.index_add_(0, (rows.reshape(-1) + 1) % k_rows.shape[0],", LAYER),
    "layer gate scores: empty slots pass a gradient": (LGL, "used = (anchors >= 0)[..., None]", "used = (anchors >= -1)[..., None]", LAYER),
    "layer gate kernel output scaled by 1.01": (LGK, "acc.to(Out_ptr.dtype.element_ty)", "(acc * 1.01).to(Out_ptr.dtype.element_ty)", LAYER),
    "layer span start uses t instead of t - s": (GEO, "back_len = span_length_table(backward_factor, span_power, key_length, qanchor.device)[distance]", "back_len = span_length_table(backward_factor, span_power, key_length, qanchor.device)[(distance + first_allowed[:, None]).clamp(max=key_length)]", LAYER),
    "layer span end ignores the forward factor": (ANCHOR_SPANS, "settings.forward_factor, settings.span_power,\n    )", "0.0, settings.span_power,\n    )", LAYER),
    "layer span start off by one": (GEO, "torch.maximum(qanchor.to(torch.int64) - back_len[:, None, :, None], first_allowed", "torch.maximum(qanchor.to(torch.int64) - back_len[:, None, :, None] + 1, first_allowed", LAYER),
    "reference window start off by one": (REF, "window_lo = (pos - window + 1).clamp(min=0)", "window_lo = (pos - window + 2).clamp(min=0)", f"{VARIANTS} -k reference"),
    "reference forward: blocks merged without rescaling the earlier ones": (REF, "rescale = torch.exp(row_max - shift)", "rescale = torch.exp(shift - shift)", f"{BLOCKS} -k oracle"),
    "reference forward: a key block's last key skipped": (REF, "        end = min(first + block, k.shape[0])\n", "        end = min(first + block, k.shape[0]) - 1\n", f"{BLOCKS} -k oracle"),
    "reference forward: every chunk of queries takes the first chunk's spans": (REF, "SpanSegments(*(t[rows] for t in group))", "SpanSegments(*(t[: rows.stop - rows.start] for t in group))", f"{BLOCKS} -k oracle"),
    "reference forward: a poisoned K row counted at every key": (REF, "bad_keys = bad_keys + weights @", "bad_keys = bad_keys + torch.ones_like(weights) @", "tests/api/test_extreme_inputs.py -k 'poisoned or nonfinite'"),
    "hardening: window not clamped to the keys": (LAUNCH, "window=min(int(window), key_length),", "window=int(window),", f"{INPUTS} -k huge_window"),
    "hardening: empty slot reads key 0 for dQ1": (LGL, "d_q1 = torch.where(used, grad[..., None] * keys, 0.0).sum(dim=-2)", "d_q1 = (grad[..., None] * keys).sum(dim=-2)", f"{INPUTS} -k masked_key_zero"),
    "hardening: empty slot adds 0 * Q1 to dK": (LGL, "contributions = torch.where(used, grad[..., None] * q1.to(grad.dtype)[..., None, :], 0.0)", "contributions = grad[..., None] * q1.to(grad.dtype)[..., None, :]", f"{INPUTS} -k q1_row_nobody"),
    "hardening: backward reads non-finite values": (C, "return tl.where(tl.abs(x) < float(\"inf\"), x, 0.0)", "return x", f"{INPUTS} -k poisoned"),
    "hardening: tile backward keeps poisoned rows": (TCB, "live = lse == lse  # a poisoned (NaN) row", "live = (lse == lse) | (lse != lse)  #", f"{INPUTS} -k poisoned"),
    "hardening: combine takes a NaN lse as c": (TCB, "c = tl.minimum(c, tl.where(lse == lse, lse, float(\"inf\")))", "c = tl.minimum(c, lse)", f"{INPUTS} -k poisoned"),
    "hardening: per-query backward keeps poisoned rows": (B, "live = lse == lse  # a poisoned (NaN) span", "live = (lse == lse) | (lse != lse)  #", f"{INPUTS} -k poisoned"),
    "hardening: tensor-core backward reads non-finite K": (TCB, "key_value_pair(torch.nan_to_num(geo.k, nan=0.0, posinf=0.0, neginf=0.0), geo.v)", "key_value_pair(geo.k, geo.v)", f"{INPUTS} -k poisoned"),
    "hardening: tensor-core backward's sorted Q rows keep non-finite entries": (TCB, "tl.store(Qs_ptr + sorted_offsets, finite_or_zero(q), mask=rd_mask)", "tl.store(Qs_ptr + sorted_offsets, q, mask=rd_mask)", f"{INPUTS} -k poisoned"),
    "tensor-core backward: window dK/dV skips a part's last head": (WTB, "tl.minimum(part * PART_HEADS + PART_HEADS, REP)", "tl.minimum(part * PART_HEADS + PART_HEADS, REP) - 1", "tests/ops/span_attention/test_tile_backward.py -k head_parts"),
    "tensor-core backward: split dK unscaled": (WTB, "tl.atomic_add(dK_ptr + out, dk * sm_scale,", "tl.atomic_add(dK_ptr + out, dk,", "tests/ops/span_attention/test_tile_backward.py -k head_parts"),
    "tensor-core backward: split dV never written": (WTB, "        dv.copy_(dv32)\n", "", "tests/ops/span_attention/test_tile_backward.py -k head_parts"),
    "hardening: decode detached when a grad is required": (API, "    if requires_grad(Q1, Q2, K, V):\n", "    if False:\n", f"{INPUTS} -k decode_is_diff"),
    "hardening: empty result detached": (API, "    return out + sum(t.sum() * 0 for t in inputs)", "    return out", f"{INPUTS} -k empty_inputs"),
    "eager calls without gradients go through the custom ops": (TORCH_OPS, "    return _IMPLEMENTATIONS[op](*args)", "    return op(*args)", "tests/api/test_torch_ops.py -k eager_calls"),
    "eager calls with gradients go through the custom ops": (TORCH_OPS, "return functions[op].apply(*args) if op in functions else op(*args)", "return op(*args)", "tests/api/test_torch_ops.py -k eager_autograd"),
    "torch.func takes the eager Function without setup_context": (TORCH_OPS, "functions = _TRANSFORMABLE_AUTOGRAD if torch._C._are_functorch_transforms_active() else _EAGER_AUTOGRAD", "functions = _EAGER_AUTOGRAD", "tests/api/test_torch_ops.py -k torch_func"),
    "eager backward calls the backward custom op": (TORCH_OPS, "staticmethod(functools.partial(formula, run))", "staticmethod(functools.partial(formula, _call_op))", "tests/api/test_torch_ops.py -k eager_autograd"),
    "TMA: whole key blocks read one key late": (C, "    k = k_desc.load([row, 0])", "    k = k_desc.load([row + 1, 0])", f"{TCF_TESTS} -k descriptors"),
    "TMA: span tiles read the first batch row's keys": (TCF, "(group * L_KV).to(tl.int32),", "((group % H_KV) * L_KV).to(tl.int32),", f"{TCF_TESTS} -k descriptors"),
    "TMA: window tiles read the first batch row's keys": (WIN, "desc_row = ((batch * (H_Q // REP) + head // REP) * L_KV)", "desc_row = ((head // REP) * L_KV)", f"{TCF_TESTS} -k descriptors"),
    "TMA: the whole blocks skip their first": (WIN, "acc, m, l, first_inner, end_inner, q,", "acc, m, l, first_inner + 1, end_inner, q,", f"{TCF_TESTS} -k descriptors"),
    "edge TMA: edge blocks through TMA at any window": (TCF, "edge_tma = descriptors is not None and geo.window >= block_n", "edge_tma = descriptors is not None", f"{TCF_TESTS} -k edge_blocks"),
    "edge TMA: never used": (TCF, "edge_tma = descriptors is not None and geo.window >= block_n", "edge_tma = False", f"{TCF_TESTS} -k descriptors"),
    "edge TMA: the last edge blocks without row masks": (WIN, "acc, m, l, end_inner, n_blocks, q, K_ptr, V_ptr, kv_base, stride_kl, mask_ptr, mask_base, tile_lo, tile_hi,\n        row_lo, row_hi, offs_d, d_mask, qk_scale, k_desc, v_desc, desc_row, BLOCK_N, True, HAS_MASK, EDGE_TMA,", "acc, m, l, end_inner, n_blocks, q, K_ptr, V_ptr, kv_base, stride_kl, mask_ptr, mask_base, tile_lo, tile_hi,\n        row_lo, row_hi, offs_d, d_mask, qk_scale, k_desc, v_desc, desc_row, BLOCK_N, EDGE_TMA == 0, HAS_MASK, EDGE_TMA,", f"{TCF_TESTS} -k descriptors"),
    "span-tile plan: spans not kept before the window": (TILES, "    hi = tl.where(WINDOW > 0, tl.minimum(hi, pos - WINDOW), hi)\n", "", f"{TCF_TESTS} -k plan_order"),
    "span-tile plan: the position of the wrong query": (TILES, "pos_ptr + (triple // K_SPANS) % L_Q", "pos_ptr + triple % L_Q", f"{TCF_TESTS} -k plan_order"),
    "span-tile plan: empty spans not sorted last": (TILES, "key = tl.where(hi < lo, 0x7FFFFFFF, key).to(tl.int32)", "key = key.to(tl.int32)", f"{TCF_TESTS} -k plan_order"),
    "span-tile plan: bounds of the unsorted triples": (TILES, "triple = tl.load(order_ptr + group * N_TRIPLES + offs, mask=ok, other=0)", "triple = offs.to(tl.int64)", f"{TCF_TESTS} -k plan_order"),
    "positions: int32 ones past the last key unclamped": (API, "    return cache_position.clamp(-1, key_length - 1)", "    return cache_position if cache_position.dtype == torch.int32 else cache_position.clamp(-1, key_length - 1)", f"{HAPI} -k int32_positions"),
    "span-tile plan: int32 positions past the last key unclamped": (TILES, "pos = tl.minimum(tl.load(pos_ptr + (triple // K_SPANS) % L_Q, mask=ok, other=-1).to(tl.int64), L_KV - 1)", "pos = tl.load(pos_ptr + (triple // K_SPANS) % L_Q, mask=ok, other=-1).to(tl.int64)", f"{TCF_TESTS} -k plan_order"),
    "online softmax: probabilities of unscaled scores": (C, "p = tl.exp2(s * qk_scale - m_ref[:, None])", "p = tl.exp2(s - m_ref[:, None])", f"{FWD} -k tc_tiles"),
    "span-tile plan: unused slots attend key 0": (TILES, "return tl.maximum(qstart, 0), tl.where(qend < 0, -1, hi)", "return tl.maximum(qstart, 0), tl.maximum(hi, 0)", f"{TCF_TESTS} -k plan_order"),
    "TMA: backward descriptors despite an attention mask": (WIN, "return None if geo.has_mask else row_descriptors(geo.k, geo.v, block_n)", "return row_descriptors(geo.k, geo.v, block_n)", f"{TCF_TESTS} -k descriptors"),
    "tile split: the suffix starts 8 keys early": (WIN, "suffix_start = tl.load(suffix_ptr + batch)", "suffix_start = tl.load(suffix_ptr + batch) - 8", f"{TCF_TESTS} -k suffix"),
    "tile split: the masked launch takes no tile": (WIN, "taken = tile_lo < suffix_start", "taken = tile_lo < 0", f"{TCF_TESTS} -k suffix"),
    "allowed suffix: a hole after the first allowed key ignored": (WIN, "return torch.where(hidden == first, first, keys).to(torch.int32)", "return first.to(torch.int32)", f"{TCF_TESTS} -k 'suffix or masked_key_blocks'"),
    "forward TMA mask: no second pass": (WIN, "        if holds_nan(acc):\n", "        if holds_nan(acc) & False:\n", f"{TCF_TESTS} -k 'masked_key_blocks or nan_rules'"),
    "forward TMA mask: the second pass through TMA again": (WIN, "BLOCK_M, BLOCK_D, BLOCK_N, HAS_MASK, False, False, UPCAST)", "BLOCK_M, BLOCK_D, BLOCK_N, HAS_MASK, KV_TMA, EDGE_TMA, UPCAST)", f"{TCF_TESTS} -k masked_key_blocks"),
    "forward TMA mask: hidden keys attended": (WIN, "keep, qk_scale, BLOCK_N, ROW_MASK, HAS_MASK, False, UPCAST)", "keep, qk_scale, BLOCK_N, ROW_MASK, False, False, UPCAST)", f"{TCF_TESTS} -k masked_key_blocks"),
    "forward TMA mask: batch row 0's mask for every row": (WIN, "keep = allowed_keys(mask_ptr + mask_base, tile_lo", "keep = allowed_keys(mask_ptr, tile_lo", f"{TCF_TESTS} -k masked_key_blocks"),
    "forward TMA mask: every block takes the first block's mask": (WIN, "                keep = keep_ahead\n", "                keep = keep | (keep_ahead & False)\n", f"{TCF_TESTS} -k masked_key_blocks"),
    "forward TMA mask: the mask read ahead is the current block's": (WIN, "allowed_keys(mask_ptr + mask_base, start + BLOCK_N,", "allowed_keys(mask_ptr + mask_base, start,", f"{TCF_TESTS} -k masked_key_blocks"),
    "grouped TMA: a span's last partial block skipped": (GA, "    if whole_end <= hi:\n", "    if whole_end < lo:\n", decode("grouped")),
    "grouped TMA: rows of the first batch row's keys": (GA, "desc_row = ((batch * H_KV + kv_head) * L_KV)", "desc_row = (kv_head * L_KV)", decode("grouped")),
    "stripe_spans: merge takes the next stripe's partials": (SS, "stripe = tl.sum((offsets < t - anchor).to(tl.int32), axis=0)", "stripe = tl.sum((offsets <= t - anchor).to(tl.int32), axis=0)", decode("stripe_spans")),
    "stripe_spans: merge drops each span's last chunk": (SS, "counts = tl.where(scores > float(\"-inf\"), N_SCHUNKS, 0)", "counts = tl.where(scores > float(\"-inf\"), N_SCHUNKS - 1, 0)", "tests/ops/staged_decode/test_decode.py -k 'several_chunks and stripe_spans'"),
    "stripe_spans: bf16 output scaled by 1.01": (SS, "    return g.out\n", "    return g.out * 1.01 if g.q2.dtype == torch.bfloat16 else g.out\n", decode("stripe_spans")),
    "stripe_spans: a stripe's span starts one key early": (GST, "lo = (tl.maximum(loc - tl.load(back_ptr + t), 0) + chunk", "lo = (tl.maximum(loc - tl.load(back_ptr + t) - 1, 0) + chunk", decode("stripe_spans")),
    "stripe_spans: forward length ignores the first allowed key": (GST, "hi = tl.minimum(hi, loc + reach).to(tl.int32)", "hi = hi", decode("stripe_spans")),
    "stripe_spans: first allowed key read in the first slice only": (GST, "while (first == L_KV) & (start < window_start):", "while (start == 0) & (start < window_start):", "tests/ops/staged_decode/test_decode.py -k 'first_allowed and stripe_spans'"),
    "stripe_spans: chunks of a span overlap by a key": (GST, "0) + chunk * SCHUNK).to(tl.int32)", "0) + chunk * (SCHUNK - 1)).to(tl.int32)", "tests/ops/staged_decode/test_decode.py -k 'several_chunks and stripe_spans'"),
    "stripe_spans: chunks stored past their stripe's places": (GST, "places = N_STRIPES * N_SCHUNKS  # partials per row", "places = N_STRIPES * N_SCHUNKS + 1", decode("stripe_spans")),
    "stripe_spans: span programs read Q2 with Q1's strides": (GST, "            stride_q2b, stride_q2h, stride_kb, stride_kh, stride_kl, stride_mb,\n            H_Q, L_KV, REP, WINDOW, N_STRIPES,", "            stride_q1b, stride_q1h, stride_kb, stride_kh, stride_kl, stride_mb,\n            H_Q, L_KV, REP, WINDOW, N_STRIPES,", "tests/ops/staged_decode/test_decode.py -k 'own_strides and stripe_spans'"),
    "sanitize child looks its layout up among the whole workload's": (SAN, "case = next(small for c in load(workload_path).cases(device_identity(device), None)\n", "case = next(small for c in layouts(workload_path, device_identity(device), None)\n", "tests/tuner/test_sanitize.py -k child_finds"),
    "sanitize child ignores the problem key": (SAN, "if c.label == label and key_of((small := small_case(c)).problem).text() == key)", "if c.label == label and (small := small_case(c)) is not None)", "tests/tuner/test_sanitize.py -k share_a_label"),
    "layer spans kernel: start not clamped at the first allowed key": (LSP, "qstart = tl.maximum(anchor - tl.load(back_ptr + distance, mask=live, other=0), first)", "qstart = anchor - tl.load(back_ptr + distance, mask=live, other=0)", SPANS),
    "layer spans kernel: distance one short": (LSP, "distance = tl.minimum(tl.maximum(pos + 1 - first, 0), L_KV)", "distance = tl.minimum(tl.maximum(pos - first, 0), L_KV)", SPANS),
    "layer spans kernel: end not kept before the window": (LSP, "limit = tl.where(WINDOW == 0, pos, pos - WINDOW)", "limit = pos", SPANS),
    "layer spans kernel: position not clamped to the keys": (LSP, "pos = tl.minimum(tl.maximum(pos, 0), L_KV - 1)", "pos = tl.maximum(pos, 0)", SPANS),
    "layer spans kernel: first allowed key of the wrong row": (LSP, "first = tl.load(first_ptr + offs // ROW, mask=live, other=0)", "first = tl.load(first_ptr + 0 * offs, mask=live, other=0)", SPANS),
    "layer spans kernel: last program's tail unwritten": (LSP, "live = offs < N", "live = offs < N // BLOCK * BLOCK", SPANS),
    "float64 layer's spans through the GPU path": ("superlinear_ops/ops/layer/composition.py", "    if dtype == torch.float64:  # the float64 layer", "    if False:  # the float64 layer", f"{LAYER} -k float64"),
    "side stream: no allocator mark for the current stream": ("superlinear_ops/ops/side_stream.py", "            tensor.record_stream(self._main)", "            pass", "tests/ops/test_side_stream.py"),
    "side stream: no fork before the side stream's launches": ("superlinear_ops/ops/side_stream.py", "            self._fork.side.wait_event(self._fork.forked)", "            pass", "tests/ops/test_side_stream.py"),
    "side stream: the pool's current stream used as the side stream": ("superlinear_ops/ops/side_stream.py", "        while side == main:", "        while False:", "tests/ops/test_side_stream.py"),
    "side stream: no join before the span-tile kernel": (TCF, "    side.join(plan.order, plan.lo, plan.hi)\n    block_m, block_n", "    block_m, block_n", f"{TCF_TESTS} -k beside"),
    "side stream: the plan queued on the current stream": (TCF, "    with side:\n        plan = span_tile_plan(geo, SPAN_START_BLOCK)", "    if True:\n        plan = span_tile_plan(geo, SPAN_START_BLOCK)", f"{TCF_TESTS} -k beside"),
    "TMA: window dQ whole blocks read one key late": (WTB, "            k = k_desc.load([desc_row + tile_lo + i * BLOCK_N, 0])", "            k = k_desc.load([desc_row + tile_lo + i * BLOCK_N + 1, 0])", "tests/ops/span_attention/test_tile_backward.py -k descriptors"),
    "TMA: window dQ skips the block after the whole ones": (WTB, "(first_inner, end_inner, whole, n_blocks)[segment]", "(first_inner, end_inner, whole, whole)[segment]", "tests/ops/span_attention/test_tile_backward.py -k descriptors"),
    "sorted rows: combine writes the window rows in query order": (TCB, "place = rows - query + tl.load(rank_ptr + query, mask=row_ok, other=0)", "place = rows", "tests/ops/span_attention/test_tile_backward.py -k backward_matches"),
    "sorted rows: span tiles read q at the query's own row": (TCB, "* L_Q + tl.load(rank_ptr + query, mask=row_ok, other=0)", "* L_Q + query", "tests/ops/span_attention/test_tile_backward.py -k backward_matches"),
    "sorted rows: rank written as the identity": (WTB, "tl.store(rank_ptr + query, offs, mask=in_q)", "tl.store(rank_ptr + offs, offs, mask=in_q)", f"{WTABLES}"),
    "sorted rows: window dQ stored at the sorted place": (WTB, "rows = tl.where(row_ok, row_base + tl.load(perm_ptr + sorted_idx, mask=row_ok, other=0), -1)", "rows = tl.where(row_ok, row_base + sorted_idx, -1)", "tests/ops/span_attention/test_tile_backward.py -k descriptors"),
    "TMA: window dK/dV query tile read one row late": (WTB, "q = q_desc.load([(row_base + t * BLOCK_M).to(tl.int32), 0])", "q = q_desc.load([(row_base + t * BLOCK_M + 1).to(tl.int32), 0])", "tests/ops/span_attention/test_tile_backward.py -k descriptors"),
    "TMA: window dK/dV dO* tile of the next tile": (WTB, "dos = do_desc.load([(row_base + t * BLOCK_M).to(tl.int32), 0])", "dos = do_desc.load([(row_base + t * BLOCK_M + BLOCK_M).to(tl.int32), 0])", "tests/ops/span_attention/test_tile_backward.py -k descriptors"),
    "TMA: window dK/dV keeps the next head's dO* rows": (WTB, "dos = tl.where((sorted_idx < L_Q)[:, None], dos, 0.0)", "dos = dos", "tests/ops/span_attention/test_tile_backward.py -k non_finite"),
    "window dK/dV pointer rows: c of the next row": (WTB, "c = tl.load(c_ptr + row_base + sorted_idx, mask=row_ok, other=float(\"inf\"))", "c = tl.load(c_ptr + row_base + sorted_idx + 1, mask=row_ok, other=float(\"inf\"))", "tests/ops/span_attention/test_tile_backward.py -k descriptors"),
    "window dK/dV: full tiles from a tile whose first row misses the block's last key": (WTB, "(first_pos < key_hi)", "(first_pos < key_hi - 1)", f"{WFULL}"),
    "window dK/dV: full tiles up to a tile whose last window misses the block's first key": (WTB, "(last_pos - WINDOW + 1 <= key_lo)", "(last_pos - WINDOW <= key_lo)", f"{WFULL}"),
    "window dK/dV: full tiles ignore the attention mask": (WTB, "        if ROW_MASK or HAS_MASK:\n            pt = tl.where(attend, pt, 0.0)\n        dv +=", "        if ROW_MASK:\n            pt = tl.where(attend, pt, 0.0)\n        dv +=", f"{WFULL}"),
    "window dK/dV: the full tiles skipped": (WTB, "(full_lo, full_hi + 1, t_last + 1)[segment]", "(full_lo, full_lo, t_last + 1)[segment]", f"{WFULL}"),
    "inner blocks from the block before": (C, "first = tl.minimum(tl.cdiv(tl.maximum(inner_lo - tile_lo, 0), BLOCK_N), n_blocks)", "first = tl.minimum(tl.maximum(inner_lo - tile_lo, 0) // BLOCK_N, n_blocks)", f"{WFULL}"),
    "inner blocks up to the block after": (C, "tl.minimum((inner_hi - tile_lo + 1) // BLOCK_N, n_blocks)", "tl.minimum((inner_hi - tile_lo + 1) // BLOCK_N + 1, n_blocks)", f"{WFULL}"),
    "gate-score backward: dK atomics in Triton's default order": (LGK, ', mask=rd_used,\n                      sem="relaxed")', ", mask=rd_used)", "tests/ops/test_kernel_atomics.py"),
    "window dQ: edge blocks ignore the attention mask": (WTB, "attend = attend & allowed[None, :]", "attend = attend", "tests/ops/span_attention/test_tile_backward.py -k very_negative"),
    "window tables: a tile ending at a block's first key counted before it": (WTB, "passes = (tile_hi < key) if BY_HI", "passes = (tile_hi <= key) if BY_HI", f"{WTABLES}"),
    "window tables: the run of tiles ends one tile early": (WTB, "DQ_ROWS - 1, N_DKDV_TILES, L_Q, WINDOW, DKDV_ROWS, False, STEPS) - 1", "DQ_ROWS - 1, N_DKDV_TILES, L_Q, WINDOW, DKDV_ROWS, False, STEPS) - 2", f"{WTABLES}"),
    "window tables: one halving too few": (WTB, "STEPS=max(1, n_dkdv_tiles.bit_length())", "STEPS=max(1, n_dkdv_tiles.bit_length() - 1)", f"{WTABLES}"),
    "window tables: one halving short at a power-of-two tile count": (WTB, "STEPS=max(1, n_dkdv_tiles.bit_length())", "STEPS=max(1, (n_dkdv_tiles - 1).bit_length())", f"{WTABLES}"),
    "window tables: programs sized by the queries alone": (WTB, "triton.cdiv(max(lq, n_key_blocks), TABLE_BLOCK)", "triton.cdiv(lq, TABLE_BLOCK)", f"{WTABLES}"),
    "window tables: a dQ tile's range ends one row early": (WTB, "tl.minimum(tile * ROWS + ROWS - 1, L_Q - 1)", "tl.minimum(tile * ROWS + ROWS - 2, L_Q - 1)", f"{WTABLES}"),
    "window tables: positions not clamped before the sort": (WTB, "torch.sort(cache_position.clamp(max=key_length - 1), stable=True)", "torch.sort(cache_position, stable=True)", f"{WTABLES}"),
    "window tables: no window read as a window of one key": (WTB, "return lo, tl.where(WINDOW > 0, last, lo - 1)", "return lo, tl.where(WINDOW >= 0, last, lo - 1)", f"{WTABLES}"),
    "row masks: the last key of each row dropped": (C, "(offs_n[None, :] <= row_hi[:, None])", "(offs_n[None, :] < row_hi[:, None])", f"{FWD} -k tc_tiles"),
    "tuner re-tune forgets the earlier winner": (TUNE, "earlier=earlier,", "earlier=None,", "tests/tuner/test_tuner.py -k retune"),
    "store: a writer that lost the schema race gives up": ("superlinear_ops/cache/store.py", "                store._check_schema(create=True)\n        except BaseException:", "                raise\n        except BaseException:", "tests/cache/test_cache_concurrency.py -k schema"),
    "store: a rival's schema skipped and a second version row added": ("superlinear_ops/cache/store.py", "checkfirst=False)", "checkfirst=True)", "tests/cache/test_cache_concurrency.py -k schema"),
    "tune: workers started before the store has its schema": ("superlinear_ops/tuner/tune.py", "            Store.writer(cache).close()  # create the store's schema once, before the workers start\n", "", "tests/tuner/test_tuner.py -k after_the_store"),
    "hardening: topk not clamped to the stripes": (SETTINGS, "return settings if torch.compiler.is_compiling() else settings.for_keys(key_length)", "return settings", f"{INPUTS} -k huge_topk"),
    "decode checks: the int64 mask holds only 0 and 1": ("superlinear_ops/ops/staged_decode/spec.py", "x.mask.to(torch.int64) << 32", "x.mask.to(torch.int64)", "tests/tuner/test_tuner_isolation.py -k low_word"),
    "tuner: a sibling GPU's winner is not measured": ("superlinear_ops/tuner/tune.py", "sibling = None if stored is not None else sibling_winner(store, shipped, key)", "sibling = None", "tests/tuner/test_tuner.py -k sibling"),
    "dispatcher: a borrowed entry passes for the GPU's own": ("superlinear_ops/cache/layers.py", "lender = entry.key.device if borrow else None", "lender = None", "tests/cache/test_shipped_cache.py"),
    "tuner: refused configurations use up trials": ("superlinear_ops/tuner/search.py", "return [t for t in finished_trials(study) if not {REFUSED, INTERRUPTED} & set(t.user_attrs)]", "return finished_trials(study)", "tests/tuner/test_tuner.py -k end_to_end"),
    "tuner: the borrowed sibling winner needs the margin": ("superlinear_ops/tuner/tune.py", 'confirmed["params"] in (study.user_attrs.get(EARLIER), study.user_attrs.get(SIBLING))', 'confirmed["params"] == study.user_attrs.get(EARLIER)', "tests/tuner/test_tuner.py -k side_by_side"),
    "tuner: the sibling winner is not recorded on the study": ("superlinear_ops/tuner/search.py", "study.set_user_attr(SIBLING, sibling)", "study.set_user_attr(SIBLING, None)", "tests/tuner/test_tuner.py -k sibling"),
    "decode shared memory: one K/V buffer short": (DV, "shared = (buffers * 2 * block_k", "shared = ((buffers - 1) * 2 * block_k", "tests/base/test_registry.py -k sm90"),
    "decode shared memory: 64-key window blocks ignored": (DV, "config.block_k if problem.masked else max(config.block_k, WINDOW_CHUNK)", "config.block_k", "tests/base/test_registry.py -k sm90"),
    "decode: an int64 mask's entries read for the next block": (GA, "allowed_keys(mask_row_ptr, start, hi, offs), qk_scale", "allowed_keys(mask_row_ptr, start + BLOCK_K, hi, offs), qk_scale", "tests/ops/staged_decode/test_decode_mask.py -k 'integer and int64'"),
    "decode: a first allowed key among the mask's head is dropped": (GST, "first = tl.minimum(head_first, tl.min(tl.where(allowed, keys, L_KV), axis=0))", "first = tl.min(tl.where(allowed, keys, L_KV), axis=0)", "tests/ops/staged_decode/test_decode_mask.py -k key_0"),
    "decode: a slice program reads its slice only when the head allows a key": (GST, "read = (keys < limit) & (head_first == L_KV)", "read = (keys < limit) & (head_first < L_KV)", "tests/ops/staged_decode/test_decode_mask.py -k first_allowed"),
    "arch table: positions compiled as int64 pointers": ("superlinear_ops/arch_compile.py", '"suffix_ptr", "spos_ptr", "cache_pos_ptr"})', '"suffix_ptr"})', "tests/base/test_arch_check.py -k pointer_types"),
    "verify: rows printed only once every problem is measured": ("superlinear_ops/tuner/commands.py", "    for r in verify(args.workload, select_device(args.device), args.threshold, args.problems):",
                                                                "    for r in list(verify(args.workload, select_device(args.device), args.threshold, args.problems)):", "tests/tuner/test_tuner.py -k prints_each_row"),
    "bench: an H100 without ceilings": ("superlinear_ops/tuner/bench.py", ', "NVIDIA H100 80GB HBM3": (3.0e12, 798e12)}', "}", "tests/tuner/test_tuner.py -k ceilings"),
    "stripe-tile search drops a last tile of one stripe": (STS, "for j0 in range(0, tl.max(n_c, axis=0), BLOCK_S):", "for j0 in range(0, tl.max(n_c, axis=0) - 1, BLOCK_S):", f"{EDGES} -k stripe_tiles"),
    "stripe-tile search drops a last stripe that ends its tile": (STS, "    valid = j < n_c\n", "    valid = (j < n_c) & ((offs_s < tl.max(offs_s, axis=0)) | (j + 1 < n_c))\n", f"{EDGES} -k stripe_tiles"),
    "stripe-tile search drops the last stripe past the first tile": (STS, "    valid = j < n_c\n", "    valid = (j < n_c) & ((j0 == 0) | (j + 1 < n_c))\n", f"{EDGES} -k stripe_tiles"),
    "stripe-tile search reads the table's last stripe at the one before": (STS, "tl.minimum(j, N_STRIPES - 1)", "tl.minimum(j, N_STRIPES - 2)", f"{EDGES} -k stripe_tiles"),
    "layer search drops a query block's last stripe": (LSK, "for j in range(0, tl.max(n_k, axis=0)):", "for j in range(0, tl.max(n_k, axis=0) - 1):", f"{EDGES} -k tiled_search"),
    "layer search reads the table's last stripe at the one before": (LSK, "tl.minimum(j, N_STRIPES - 1)", "tl.minimum(j, N_STRIPES - 2)", f"{EDGES} -k tiled_search"),
    "tuner: a sticky error leaves its worker in place": ("superlinear_ops/tuner/worker.py", "str(err))), err.sticky or not context_usable(bench.device)", "str(err))), not context_usable(bench.device)", "tests/tuner/test_worker_faults.py -k sticky"),
    "tuner: a worker found dead between candidates is reused": ("superlinear_ops/tuner/worker.py", "            self._kill()  # it died between candidates", "            pass  # it died between candidates", "tests/tuner/test_worker_faults.py -k killed"),
    "hopper tiles: the running sum never rescaled": (HOP, "            acc = acc * gl.convert_layout(alpha, o_rows)[:, None]\n", "", HOP_TESTS),
    "hopper tiles: the last edge blocks unmasked": (HOP, "(j < first_inner) | (j >= end_inner)", "j < first_inner", HOP_TESTS),
    "hopper tiles: the first block unmasked": (HOP, "(first_inner > 0) | (end_inner < 1)", "end_inner < 1", HOP_TESTS),
    "hopper tiles: the producer one block ahead": (HOP, "[first_key_row + j * BLOCK_N, 0], v_ready", "[first_key_row + (j + 1) * BLOCK_N, 0], v_ready", HOP_TESTS),
    "hopper tiles: the window drops its first key": (HOP, "return gl.maximum(pos - WINDOW + 1, 0)", "return gl.maximum(pos - WINDOW + 2, 0)", HOP_TESTS),
    "hopper tiles: the second consumer takes the first one's span rows": (HOP, "first = gl.program_id(0) * TILE_ROWS + HALF * HALF_ROWS", "first = gl.program_id(0) * TILE_ROWS", HOP_TESTS),
    "hopper tiles: values past the range not zeroed": (HOP, "if last_key0 + BLOCK_N - 1 > tile_hi:", "if last_key0 + BLOCK_N - 1 > tile_hi + BLOCK_N:", HOP_TESTS),
    "hopper tiles: window part dropped in the merge": (HOP, "    beta = gl.exp2(lw - m_ref)\n", "    beta = gl.exp2(lw - m_ref) * 0.0\n", HOP_TESTS),
    "explain: causes as reason templates with their numbers stripped": ("superlinear_ops/arch_check.py", "causes.setdefault(cause_of(reason), [])", "causes.setdefault(\" \".join(w for w in reason.split() if not any(c.isdigit() for c in w)), [])", "tests/base/test_explain_summary.py"),
    "explain: an example that is no reason of its cause": ("superlinear_ops/arch_check.py", "e.g. {min(reasons)}", "e.g. {min(reasons)[:40]}", "tests/base/test_explain_summary.py"),
}


def copy_repository(dest: pathlib.Path) -> None:
    """The tracked and untracked-but-not-ignored files of the checkout (no .venv, no caches)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def run_tests(copy: pathlib.Path, target: str, env: dict) -> tuple[bool, str]:
    """(caught, pytest's last line): caught when pytest exits 1 after failed tests."""
    result = subprocess.run(f"{sys.executable} -m pytest -q -x -p no:xdist -p no:cacheprovider {target}", shell=True, cwd=copy, check=False,
                            env=env, capture_output=True, text=True)
    lines = result.stdout.strip().splitlines() or ["(no output)"]
    last = lines[-1]
    raised = re.search(r"^E\s+(assert|\w+(?:Error|Exception|Exit))\b", result.stdout, re.MULTILINE)
    kind = "no exception shown" if raised is None else {"assert": "AssertionError"}.get(raised.group(1), raised.group(1))
    caught = result.returncode == 1 and re.search(r"\d+ failed", last) is not None and kind == "AssertionError"
    return caught, f"exit {result.returncode}, {kind}: {last}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="only the plants whose name contains this")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copy")
    args = parser.parse_args()
    copy = pathlib.Path(tempfile.mkdtemp(prefix="plant_bugs_"))
    copy_repository(copy)
    # The copy first; the rest of PYTHONPATH stays for dependencies installed there.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(copy), os.environ.get("PYTHONPATH")])),
           "PYTHONDONTWRITEBYTECODE": "1"}
    where = subprocess.run([sys.executable, "-c", "import superlinear_ops; print(superlinear_ops.__file__)"],
                           cwd=copy, env=env, capture_output=True, text=True, check=False).stdout.strip()
    if not where.startswith(str(copy)):
        print(f"the copy's package is not the one imported ({where}); aborting", file=sys.stderr)
        return 2
    chosen = {name: plant for name, plant in PLANTS.items() if args.only in name}
    caught_count = 0
    try:
        for name, (path, old, new, target) in chosen.items():
            source = (copy / path).read_text()
            if source.count(old) != 1:
                print(f"{name:48s} -> STALE: the planted text occurs {source.count(old)} times in {path}")
                continue
            (copy / path).write_text(source.replace(old, new))
            try:
                caught, detail = run_tests(copy, target, env)
            finally:
                (copy / path).write_text(source)
            caught_count += caught
            print(f"{name:48s} -> {'CAUGHT' if caught else 'MISSED'} ({detail})", flush=True)
    finally:
        if args.keep:
            print(f"copy kept at {copy}")
        else:
            shutil.rmtree(copy, ignore_errors=True)
    print(f"caught {caught_count}/{len(chosen)}")
    return 0 if caught_count == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
