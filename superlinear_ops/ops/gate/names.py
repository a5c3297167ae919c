"""What the layer's gate (SPEC section 7, step 4) shares between its kernels, its PyTorch paths, its op
specs (``ops.gate_scores``, ``ops.gate``) and its dispatch: the names of its four ops and the score
of an empty slot. Nothing here imports the kernels or the layer, so none of them import each other."""

from __future__ import annotations

GATE_SCORES = "gate_scores"  # v_j = Q1 . K[anchor_j]
GATE_SCORES_BACKWARD = "gate_scores_backward"  # (dQ1, dK) of the gate scores
GATE = "gate"  # O = sum_j softmax(v)_j O_j
GATE_BACKWARD = "gate_backward"  # (d scores, d span outputs) of the gate

EMPTY_SCORE = -1e9  # the gate score of an empty slot (SPEC section 7, step 4)
