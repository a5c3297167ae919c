"""The whole layer's stripe search and top-k (docs/semantics.md section 4, step 1), the op
``attention_layer``: ``stripe_tile_search`` and ``tiled_search`` (Triton), ``reference`` (PyTorch,
in query chunks: the fallback and the CPU path), ``spec`` and ``variants``."""
