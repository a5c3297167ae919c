"""Triton kernels for span attention. Importing a submodule imports Triton; this package does not."""
