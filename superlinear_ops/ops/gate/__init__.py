"""The layer's gate: gate scores v_j = Q1 . K[anchor_j] and the gate O = sum_j softmax(v)_j O_j over
the span outputs (docs/semantics.md section 4, step 4), and their backwards: four ops, each with a
Triton kernel and a PyTorch reference."""

EMPTY_SCORE = -1e9  # the gate score of an empty slot (anchor -1)
