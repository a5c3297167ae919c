"""What the dispatcher decides on: a problem descriptor built from a call's inputs, and the GPU.

A ``Problem`` holds plain values only (no tensors), so it can also be written by hand for
warm-up, ``explain`` and tuning workloads.
"""

from __future__ import annotations

import math
import os
import threading
from typing import NamedTuple

import torch

from . import geometry
from .registry import REGISTRY

SPAN_FORWARD = "span_forward"
SPAN_BACKWARD = "span_backward"
STAGED_DECODE = "staged_decode"
ATTENTION_LAYER = "attention_layer"
GATE_SCORES = "gate_scores"  # v_j = Q1 . K[anchor_j]
GATE_SCORES_BACKWARD = "gate_scores_backward"  # (dQ1, dK) of the gate scores
GATE = "gate"  # O = sum_j softmax(v)_j O_j
GATE_BACKWARD = "gate_backward"  # (d scores, d span outputs) of the gate
OPS = (SPAN_FORWARD, SPAN_BACKWARD, STAGED_DECODE, ATTENTION_LAYER,  # the library's own (REGISTRY.ops: all declared)
       GATE_SCORES, GATE_SCORES_BACKWARD, GATE, GATE_BACKWARD)
_DTYPE_NAMES = {dt: str(dt).removeprefix("torch.") for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}
MAX_HEAD_DIM = 256
DECODE_FACTORS = ("backward_factor", "forward_factor", "span_power")


class DeviceIdentity(NamedTuple):
    """Where kernels run: the GPU's name, compute capability and multiprocessor count.

    On the CPU, ``name`` is 'cpu' and ``arch`` says whether Triton's interpreter is on.
    """

    name: str
    arch: str
    multiprocessors: int

    @property
    def is_gpu(self) -> bool:
        """True for a CUDA device."""
        return self.arch.startswith("sm_")

    @property
    def interpreter(self) -> bool:
        """True when Triton kernels run under the CPU interpreter."""
        return self.arch == "interpreter"


_IDENTITIES: dict[tuple[str, int | None, bool], DeviceIdentity] = {}
_IDENTITY_LOCK = threading.Lock()


def device_identity(device: torch.device) -> DeviceIdentity:
    """The identity of ``device`` (memoised: properties are read once per device)."""
    interpret = device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1"
    key = (device.type, device.index, interpret)
    identity = _IDENTITIES.get(key)
    if identity is None:
        with _IDENTITY_LOCK:
            if device.type == "cuda":
                props = torch.cuda.get_device_properties(device)
                identity = DeviceIdentity(props.name, f"sm_{props.major}{props.minor}", props.multi_processor_count)
            else:
                identity = DeviceIdentity(device.type, "interpreter" if interpret else "reference", 0)
            _IDENTITIES[key] = identity
    return identity


class Problem(NamedTuple):
    """One op call's shape, settings and device, as the registry and dispatcher see it.

    ``spans`` is K (span slots per query; topk for decode). ``power`` is 'int<n>' on the integer
    path or 'float<p>' (``PowerParams.label``). ``factors`` holds what sizes decode's loops: (backward_factor,
    forward_factor, span_power) for the ops that search (decode and the whole layer); empty for the span
    ops, whose span lengths come with the data.
    """

    op: str
    dtype: str
    head_dim: int
    q_heads: int
    kv_heads: int
    spans: int
    queries: int
    keys: int
    batch: int
    masked: bool
    sw_index: int
    power: str
    device: DeviceIdentity
    factors: tuple[float, ...] = ()

    def check(self) -> "Problem":
        """This problem, after checking every field; ValueError/TypeError naming the first bad one."""
        if self.op not in REGISTRY.ops:
            raise ValueError(f"op must be one of {REGISTRY.ops}, got {self.op!r}")
        spec = REGISTRY.spec(self.op)
        if self.dtype not in _DTYPE_NAMES.values():
            raise ValueError(f"dtype must be one of {tuple(_DTYPE_NAMES.values())}, got {self.dtype!r}")
        for name in ("head_dim", "q_heads", "kv_heads", "spans", "queries", "keys", "batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.head_dim > MAX_HEAD_DIM:
            raise ValueError(f"head_dim must be at most {MAX_HEAD_DIM}, got {self.head_dim}")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"q_heads ({self.q_heads}) must be a multiple of kv_heads ({self.kv_heads})")
        spec.check(self)
        if not isinstance(self.masked, bool):
            raise TypeError(f"masked must be a bool, got {self.masked!r}")
        if isinstance(self.sw_index, bool) or not isinstance(self.sw_index, int) or self.sw_index < 0:
            raise ValueError(f"sw_index must be a non-negative int, got {self.sw_index!r}")
        if not isinstance(self.power, str):
            raise TypeError(f"power must be a label such as 'float0.55' or 'int2', got {self.power!r}")
        geometry.PowerParams.from_label(self.power)  # ValueError naming the power label
        if not isinstance(self.device, DeviceIdentity):
            raise TypeError(f"device must be a DeviceIdentity (see device_identity), got {self.device!r}")
        names = DECODE_FACTORS if spec.searching else ()
        if not isinstance(self.factors, tuple) or len(self.factors) != len(names):
            raise ValueError(f"factors must be ({', '.join(names)}) for {self.op}, got {self.factors!r}")
        for name, value in zip(names, self.factors):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        return self

    @property
    def params(self) -> geometry.PowerParams:
        """The search-power parameters."""
        return geometry.PowerParams.from_label(self.power)

    @property
    def window(self) -> int:
        """Sliding-window length W."""
        return geometry.window_length(self.sw_index, self.params)

    @property
    def rep(self) -> int:
        """Query heads per key/value head."""
        return self.q_heads // self.kv_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        """The inputs' torch dtype."""
        return getattr(torch, self.dtype)

    @classmethod
    def for_span(
        cls,
        op: str,
        q: torch.Tensor,
        k: torch.Tensor,
        spans: int,
        masked: bool,
        sw_index: int,
        power: str,
        factors: tuple[float, ...] = (),
    ) -> "Problem":
        """The problem of a span forward or backward call (or, with ``factors``, a decode)."""
        batch, q_heads, queries, head_dim = q.shape
        _, kv_heads, keys, _ = k.shape
        return cls(
            op, _DTYPE_NAMES[q.dtype], head_dim, q_heads, kv_heads, spans, queries, keys, batch, masked,
            sw_index, power, device_identity(q.device), factors,
        )

    @classmethod
    def for_decode(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        topk: int,
        masked: bool,
        sw_index: int,
        power: str,
        factors: tuple[float, float, float],
    ) -> "Problem":
        """The problem of a staged-decode call."""
        return cls.for_span(STAGED_DECODE, q, k, topk, masked, sw_index, power, factors)

    @classmethod
    def for_layer(
        cls,
        q1: torch.Tensor,
        k: torch.Tensor,
        topk: int,
        masked: bool,
        sw_index: int,
        power: str,
        factors: tuple[float, float, float],
    ) -> "Problem":
        """The problem of a whole-layer call (search, spans, window and gate)."""
        return cls.for_span(ATTENTION_LAYER, q1, k, topk, masked, sw_index, power, factors)
