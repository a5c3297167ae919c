"""Staged decode (docs/semantics.md section 3): one query per call, the stripe search, its spans and
the window, the gate; CUDA-graph safe. Its variants (``variants``):

- ``grouped``: search and window once per KV group on tensor cores (``group_stage``), the chosen
  spans in chunks after the search (``grouped_kernels``), two launches; ``group_attend`` holds the
  device code they share;
- ``stripe_spans``: the same first launch also attends every stripe's span once per KV group, and a
  merge launch picks each head's chosen spans (``stripe_spans_kernels``): for short contexts;
- ``group_spans``: the same first launch, then the chosen spans of all a KV group's heads per chunk
  of key positions, each key read once for the group, then a merge launch per head
  (``group_spans_kernels``);
- ``one_launch``: search, spans, window and gate of each KV group in one launch, its keys split over
  programs and merged by the last (``split_keys_kernels``): for short contexts;
- ``split_merge``: the same splits, merged by a second launch, one program per head
  (``split_keys_kernels``): for short contexts;
- ``split_window``: the stripe search in one Triton kernel (``stripe_search``,
  ``stripe_search_kernel``), then chunked span/window attention merged with the gate
  (``split_window_kernels``);
- ``staged``: search and top-k in PyTorch, then a span forward (``staged``), the baseline.
``gate_step`` holds the gate they share, ``tables`` the exact integer tables they read on the device.
"""
