"""Mutation check: plant one bug per kernel variant and decode step, run the tests that must catch it.

Run from the repository root (with the test dependencies installed):  python scripts/plant_bugs.py
Every line must say CAUGHT; the source files are restored after each plant.
"""

import subprocess

F='superlinear_ops/kernels/span_forward.py'; B='superlinear_ops/kernels/span_backward.py'; C='superlinear_ops/kernels/common.py'; DEC='superlinear_ops/decode.py'; G='superlinear_ops/kernels/decode_grouped.py'
plants = {
 "forward drops first window key": (C, "lo = tl.maximum(pos - WINDOW + 1, 0)", "lo = tl.maximum(pos - WINDOW + 2, 0)", "tests/test_span_kernels.py::test_forward_matches_reference"),
 "per-span dQ scaled": (B, "tl.atomic_add(dq_ptrs, dq * sm_scale, mask=d_mask)", "tl.atomic_add(dq_ptrs, dq * sm_scale * 1.01, mask=d_mask)", "tests/test_span_kernels.py -k per_span"),
 "fused dQ scaled": (B, "tl.store(dq_ptrs, dq * sm_scale, mask=d_mask)", "tl.store(dq_ptrs, dq * sm_scale * 1.01, mask=d_mask)", "tests/test_span_kernels.py -k fused"),
 "shared dK/dV wrong kv head": (B, "dkv_base = (batch * (H_Q // REP) + kv_head) * L_KV * D_HEAD", "dkv_base = (batch * (H_Q // REP) + (kv_head + 1) % (H_Q // REP)) * L_KV * D_HEAD", "tests/test_span_kernels.py -k shared"),
 "split dK/dV wrong q head": (B, "dkv_base = (batch * H_Q + head) * L_KV * D_HEAD", "dkv_base = (batch * H_Q + (head + 1) % H_Q) * L_KV * D_HEAD", "tests/test_span_kernels.py -k split"),
 "fused window misses last span's dV": (B, "dv += p[:, None] * do[None, :]", "dv += p[:, None] * do[None, :] * (j < N_SLOTS - 1 or N_SLOTS == 1)", "tests/test_span_kernels.py -k fused"),
 "decode gate halves scores": (DEC, "gate = torch.softmax(gate_logits, dim=-1)", "gate = torch.softmax(gate_logits / 2, dim=-1)", "tests/test_decode.py"),
 "fused search span start off by one": ("superlinear_ops/kernels/decode_search.py", "tl.maximum(anchor - back, 0)", "tl.maximum(anchor - back + 1, 0)", "tests/test_decode.py -k fused_search"),
 "fused search top-k takes the lowest score": ("superlinear_ops/kernels/decode_search.py", "best = tl.max(scores, axis=0)", "best = tl.min(tl.where(scores > float('-inf'), scores, float('inf')), axis=0)", "tests/test_decode.py -k fused_search"),
 "split decode drops the last chunk": ("superlinear_ops/kernels/decode_split.py", "for chunk in range(0, N_CHUNKS):", "for chunk in range(0, N_CHUNKS - 1):", "tests/test_decode.py -k split_window"),
 "split decode gate ignores scores": ("superlinear_ops/kernels/decode_split.py", "weight = tl.where(any_chosen, tl.exp(tl.load(score_ptr + row * K_SPANS + j) - top), 1.0) / total", "weight = 1.0 / K_SPANS", "tests/test_decode.py -k split_window"),
 "decode span start off by one": (DEC, "(anchor - back_len).clamp(min=0)", "(anchor - back_len + 1).clamp(min=0)", "tests/test_decode.py"),
 "grouped search scores halved": (G, "scores = _dot(queries, tl.trans(keys), UPCAST)", "scores = _dot(queries, tl.trans(keys), UPCAST) * 0.5", "tests/test_decode.py -k grouped"),
 "grouped candidate merge shifts slots": (G, "score = tl.where(slot == j, best, score)", "score = tl.where(slot == (j + 1) % TOPK, best, score)", "tests/test_decode.py -k grouped"),
 "grouped window chunk drops a key": (G, "hi = tl.minimum(window_hi, lo + WCHUNK - 1)", "hi = tl.minimum(window_hi, lo + WCHUNK - 2)", "tests/test_decode.py -k grouped"),
 "grouped merge halves the window": (G, "l = w_l * a_w + s_l * a_s", "l = w_l * a_w * 0.5 + s_l * a_s", "tests/test_decode.py -k grouped"),
 "grouped merge runs before the last chunk": (G, "if finished == TOPK * N_CHUNKS - 1:", "if finished == 0:", "tests/test_decode.py -k grouped"),
 "grouped first allowed key ignored": (G, "distance = tl.maximum(t - tl.where(first == L_KV, 0, first), 0)", "distance = t", "tests/test_decode.py -k grouped"),
}
for name, (path, old, new, target) in plants.items():
    src = open(path).read(); assert src.count(old) == 1, name
    open(path, 'w').write(src.replace(old, new))
    try:
        r = subprocess.run(f"pytest -q -x -n 2 {target}", shell=True, capture_output=True, text=True)
        last = r.stdout.strip().splitlines()[-1]
        print(f"{name:40s} -> {'CAUGHT' if r.returncode else 'MISSED'}: {last}")
    finally:
        open(path, 'w').write(src)
