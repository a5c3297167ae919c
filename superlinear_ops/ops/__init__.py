"""Op specs: one object per op (``spec.OpSpec``), each in its own module; ``BUILTIN`` lists the
library's, in the order the registry declares them."""

from __future__ import annotations

from .attention_layer import AttentionLayer
from .gate import Gate, GateBackward
from .gate_scores import GateScores, GateScoresBackward
from .span_backward import SpanBackward
from .span_forward import SpanForward
from .spec import OpSpec
from .staged_decode import StagedDecode

BUILTIN: tuple[OpSpec, ...] = (
    SpanForward(), SpanBackward(), StagedDecode(), AttentionLayer(), GateScores(), GateScoresBackward(), Gate(),
    GateBackward(),
)

__all__ = ["BUILTIN", "OpSpec"]
