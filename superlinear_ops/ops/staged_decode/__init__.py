"""Staged decode (semantics section 3): one module per registered variant.

- ``staged``: the original-style orchestration (search and top-k in PyTorch, then a span forward);
- ``split_window``: the stripe search in one Triton kernel (``search``, ``search_kernel``), then
  chunked span/window attention merged once per head with the gate (``split_window_kernels``);
- ``grouped``: search and window once per KV group on tensor cores, the chosen spans in chunks
  after the search, two launches (``grouped_kernels``);
- ``stripe_spans``: the same first launch also attends every stripe's span once per KV group, and a
  merge launch picks each head's chosen spans (``stripe_spans_kernels``): for short contexts;
- ``group_spans``: the same first launch, then the chosen spans of all a KV group's heads per chunk
  of key positions, each key read once for the group (``group_spans_kernels``).
``gate`` holds the gate they share, ``tables`` the exact integer tables they read on the device; their
settings are ``superlinear_ops.settings.SpanSettings`` (the layer's and the tuner's too).
"""

from ...settings import SpanSettings as DecodeSettings  # the settings' name from when only decode searched

__all__ = ["DecodeSettings"]
