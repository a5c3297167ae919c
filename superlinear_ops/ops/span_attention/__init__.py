"""Span + window attention for given spans (docs/semantics.md section 2), forward and backward.

- ``tile_forward`` / ``tile_backward`` (the ``tc_tiles`` variants): the window once per query on
  tensor cores (``window_forward``, ``window_backward``), the spans in tiles of sorted (query, span)
  pairs that share key blocks (``span_tiles``), merged by log-sum-exp;
- ``per_query_forward`` / ``per_query_backward``: one program per (query, span), the baselines;
- ``reference``: the float64 PyTorch path (the fallback and the CPU path);
- ``spec``: the ops' specs; ``variants``: their declarations.
Importing a kernel module imports Triton; this package does not.
"""
