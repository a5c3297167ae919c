"""The whole attention layer for prefill and training (semantics section 4): stripe search and top-k per
query, spans from the anchors, span + window attention, and the gate.

Modules: ``search`` (the PyTorch search: reference and CPU path), ``search_kernel`` (the Triton
search), ``attention`` (spans, span attention and the gate around any search).
"""
