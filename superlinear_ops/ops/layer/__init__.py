"""The whole attention layer for prefill and training (docs/semantics.md section 4), composed from the
ops: the search (``layer_search``), the spans from its anchors (``spans``; on a GPU one launch of
``spans_kernel``), span + window attention (``span_attention``) and the gate (``gate``), each step
run as the caller's ``composition.LayerSteps`` say."""
