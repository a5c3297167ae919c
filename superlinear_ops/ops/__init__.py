"""Op specs: one object per op (``spec.OpSpec``), each in its own module; ``BUILTIN`` lists the
library's, in the order the registry declares them."""

from __future__ import annotations

from .gate.scores_spec import GateScores, GateScoresBackward
from .gate.spec import Gate, GateBackward
from .layer_search.spec import AttentionLayer
from .span_attention.backward_spec import SpanBackward
from .span_attention.spec import SpanForward
from .spec import OpSpec
from .staged_decode.spec import StagedDecode

BUILTIN: tuple[OpSpec, ...] = (
    SpanForward(), SpanBackward(), StagedDecode(), AttentionLayer(), GateScores(), GateScoresBackward(), Gate(),
    GateBackward(),
)

__all__ = ["BUILTIN", "OpSpec"]
