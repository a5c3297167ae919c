"""Tuned caches shipped with superlinear-ops (installed as ``superlinear_ops.shipped_cache``)."""
