"""The library's ops, one folder each: its spec (what the tuner, ``bench``, ``verify`` and warm-up
know of it), its kernels and its variants (``variants``: one block per variant).

- ``span_attention``: span + window attention for given spans, forward and backward;
- ``staged_decode``: one decode step (search, spans, span attention, gate);
- ``layer_search``: the whole layer's stripe search and top-k (op ``attention_layer``);
- ``gate``: the layer's gate scores and gate, and their backwards;
- ``layer``: the whole layer composed from them (no op of its own).
``kernel_helpers`` holds the Triton helpers the kernels share, ``rules`` the rules the variants
share, ``spec`` and ``inputs`` what every op spec builds on. ``register_builtin`` declares the
library's ops and variants in a registry (the package does so once, on import); ``register_plugin``
declares a plugin module's: a new variant is one module with a ``VARIANTS`` tuple (and a new op, an
``OPS`` tuple of its specs), named in ``SUPERLINEAR_OPS_PLUGINS``.
"""

from __future__ import annotations

from types import ModuleType

from ..registry import Registry
from .gate import variants as gate_variants
from .gate.scores_spec import GateScores, GateScoresBackward
from .gate.spec import Gate, GateBackward
from .layer_search import variants as layer_search_variants
from .layer_search.spec import AttentionLayer
from .span_attention import variants as span_variants
from .span_attention.spec import SpanBackward, SpanForward
from .spec import OpSpec
from .staged_decode import variants as decode_variants
from .staged_decode.spec import StagedDecode

BUILTIN: tuple[OpSpec, ...] = (
    SpanForward(), SpanBackward(), StagedDecode(), AttentionLayer(), GateScores(), GateScoresBackward(), Gate(),
    GateBackward(),
)


def register_builtin(registry: Registry) -> None:
    """Declare the library's ops (``BUILTIN``, in that order) and every variant of theirs in ``registry``."""
    for spec in BUILTIN:
        registry.add_op(spec)
    for variants in (span_variants, decode_variants, layer_search_variants, gate_variants):
        for variant in variants.VARIANTS:
            registry.register(variant)


def register_plugin(registry: Registry, module: ModuleType) -> None:
    """Declare a plugin module's ops (``OPS``: op specs, optional) and variants (``VARIANTS``) in ``registry``."""
    if not isinstance(getattr(module, "VARIANTS", None), tuple):
        raise TypeError(f"plugin {module.__name__} must define VARIANTS, a tuple of registry.Variant")
    for spec in getattr(module, "OPS", ()):
        registry.add_op(spec)
    for variant in module.VARIANTS:
        registry.register(variant)


__all__ = ["BUILTIN", "OpSpec", "register_builtin", "register_plugin"]
