"""Exact integer geometry of span attention: power parameters, windows, stripes and span lengths.

Every integer here is defined by exact arithmetic (semantics section 1). The integer path (inv_p an
integer in 2..6) uses Python integers. The float path evaluates in float64 and settles any value
that lands within a hair of an integer with 60-digit decimal arithmetic, so float rounding can
never move a stripe, a window edge or a span end by one position.
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass
from decimal import Decimal, localcontext

import numpy as np
import torch

from .validation import check_mask_dtype

INTEGER_INV_POWERS = (2, 3, 4, 5, 6)
MIN_SEARCH_POWER = 0.02  # inv_p <= 50: smaller powers put every stripe past any key
# Below this, d ** span_power lies so close to 1 that float64 cannot tell it from 1 and the exact
# re-check would need hundreds of digits for every span length (ceil(2 * d ** 1e-100) is 3, not 2).
MIN_SPAN_POWER = 0.01
MAX_POSITION = 2**62  # bound on token positions and window lengths (exact in int64 and float64 ranks)
_NEAR_INTEGER = 1e-9  # relative distance under which float64 results are re-checked exactly


@dataclass(frozen=True)
class PowerParams:
    """The search power p and its inverse; ``inv_int`` is n on the integer path, else 0."""

    p: float
    inv_p: float
    inv_int: int

    @property
    def integer_path(self) -> bool:
        """True when stripe powers are exact integer powers."""
        return self.inv_int != 0

    @property
    def label(self) -> str:
        """'int<n>' on the integer path, else 'float<p>' (round-trips through ``from_label``)."""
        return f"int{self.inv_int}" if self.integer_path else f"float{self.p!r}"

    @property
    def arguments(self) -> dict:
        """The (search_power, inv_search_power_int) pair that gives these parameters."""
        if self.integer_path:
            return {"search_power": None, "inv_search_power_int": self.inv_int}
        return {"search_power": self.p, "inv_search_power_int": None}

    @classmethod
    def from_label(cls, label: str) -> "PowerParams":
        """Parse a ``label``."""
        if label.startswith("int"):
            return power_params(search_power=None, inv_search_power_int=int(label[3:]))
        if label.startswith("float"):
            return power_params(search_power=float(label[5:]), inv_search_power_int=None)
        raise ValueError(f"power label must be 'int<n>' or 'float<p>', got {label!r}")


def _finite_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} ({value!r})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def check_non_negative_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def power_params(*, search_power: float | None, inv_search_power_int: int | None) -> PowerParams:
    """Check the power arguments (exactly one must be given) and derive p and inv_p."""
    if (search_power is None) == (inv_search_power_int is None):
        raise ValueError(
            "give exactly one of search_power (a float in (0, 1)) or inv_search_power_int "
            f"(one of {INTEGER_INV_POWERS}); got search_power={search_power!r}, "
            f"inv_search_power_int={inv_search_power_int!r}"
        )
    if inv_search_power_int is not None:
        if isinstance(inv_search_power_int, bool) or not isinstance(inv_search_power_int, int):
            raise TypeError(
                f"inv_search_power_int must be an int, got {type(inv_search_power_int).__name__}"
            )
        if inv_search_power_int not in INTEGER_INV_POWERS:
            raise ValueError(
                f"inv_search_power_int must be one of {INTEGER_INV_POWERS}, got {inv_search_power_int}"
            )
        n = inv_search_power_int
        return PowerParams(p=1.0 / n, inv_p=float(n), inv_int=n)
    p = _finite_float("search_power", search_power)
    if not MIN_SEARCH_POWER <= p < 1.0:
        raise ValueError(f"search_power must be in [{MIN_SEARCH_POWER}, 1), got {p}")
    inv_p = 1.0 / p
    n = int(round(inv_p))
    inv_int = n if n in INTEGER_INV_POWERS and float(n) == inv_p else 0
    return PowerParams(p=p, inv_p=inv_p, inv_int=inv_int)


def check_span_power(span_power: object) -> float:
    """Return span_power as a float after checking it lies in [MIN_SPAN_POWER, 1) (where every span
    length is computed exactly)."""
    sp = _finite_float("span_power", span_power)
    if not MIN_SPAN_POWER <= sp < 1.0:
        raise ValueError(f"span_power must be in [{MIN_SPAN_POWER}, 1) (span lengths are exact there), got {sp}")
    return sp


def check_factor(name: str, value: object, *, allow_zero: bool) -> float:
    """Return a span factor as a float after checking it is finite and >= 0 (or > 0)."""
    f = _finite_float(name, value)
    if f < 0.0 or (f == 0.0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {f}")
    return f


def _exact_pow(base: int, exponent: float) -> Decimal:
    with localcontext() as ctx:
        ctx.prec = 60
        return Decimal(base) ** Decimal(exponent)


def floor_powers(bases: np.ndarray, exponent: float) -> np.ndarray:
    """floor(b ** exponent) for each integer b >= 0, exact (float64 with exact tie-breaking).

    Values above ``MAX_POSITION`` come back as ``MAX_POSITION`` (past any key: never a real stripe).
    """
    bases = np.asarray(bases, dtype=np.int64)
    if float(exponent).is_integer():
        return np.array([min(int(b) ** int(exponent), MAX_POSITION) for b in bases.tolist()], dtype=np.int64)
    values = bases.astype(np.float64) ** exponent
    too_large = values >= MAX_POSITION
    result = np.floor(np.where(too_large, MAX_POSITION, values)).astype(np.int64)
    near = np.abs(values - np.round(values)) <= _NEAR_INTEGER * np.maximum(values, 1.0)
    near &= ~too_large & (bases > 1)  # 0 and 1 are exact powers of themselves
    for i in np.flatnonzero(near).tolist():
        result[i] = int(_exact_pow(int(bases[i]), exponent).to_integral_value(rounding="ROUND_FLOOR"))
    return result


def ceil_scaled_powers(factor: float, bases: np.ndarray, exponent: float) -> np.ndarray:
    """ceil(factor * b ** exponent) for each integer b >= 0, exact (0 for b = 0 or factor = 0).

    Values above ``MAX_POSITION`` come back as ``MAX_POSITION`` (longer than any span can be).
    """
    bases = np.asarray(bases, dtype=np.int64)
    values = factor * bases.astype(np.float64) ** exponent
    too_large = values >= MAX_POSITION
    result = np.ceil(np.where(too_large, MAX_POSITION, values)).astype(np.int64)
    near = np.abs(values - np.round(values)) <= _NEAR_INTEGER * np.maximum(values, 1.0)
    for i in np.flatnonzero(near & (bases > 0) & ~too_large).tolist():
        with localcontext() as ctx:
            ctx.prec = 60
            exact = Decimal(factor) * _exact_pow(int(bases[i]), exponent)
            result[i] = int(exact.to_integral_value(rounding="ROUND_CEILING"))
    return result


def ceil_scaled_power(factor: float, base: int, exponent: float) -> int:
    """ceil(factor * base ** exponent), exact."""
    return int(ceil_scaled_powers(factor, np.array([base]), exponent)[0])


def check_window_bound(sw_index: int, params: PowerParams) -> None:
    """ValueError naming sw_index when its window W = (sw_index + 1) ** (1/p) - 1 exceeds 2**62 keys
    (pure Python: cheap, and traceable by torch.compile)."""
    exponent = float(params.inv_int) if params.integer_path else params.inv_p
    if sw_index >= MAX_POSITION or math.log(sw_index + 1) * exponent >= math.log(MAX_POSITION):
        raise ValueError(
            f"sw_index = {sw_index} gives a window longer than 2**62 keys (W = (sw_index + 1) ** {exponent:g} - 1); "
            "any window at least as long as the keys already covers them all"
        )


@functools.lru_cache(maxsize=256)
def window_length(sw_index: int, params: PowerParams) -> int:
    """Sliding-window length W = floor((sw_index + 1) ** (1/p)) - 1 for checked parameters.

    Raises ValueError naming sw_index when W would exceed ``MAX_POSITION`` (2**62) keys.
    """
    check_window_bound(sw_index, params)
    exponent = float(params.inv_int) if params.integer_path else params.inv_p
    return int(floor_powers(np.array([sw_index + 1]), exponent)[0]) - 1


def window_len_from_sw_index(
    sw_index: int, *, search_power: float | None = None, inv_search_power_int: int | None = 2
) -> int:
    """Sliding-window length W = floor((sw_index + 1) ** (1/p)) - 1 (0 when sw_index = 0)."""
    sw_index = check_non_negative_int("sw_index", sw_index)
    params = power_params(search_power=search_power, inv_search_power_int=inv_search_power_int)
    return window_length(sw_index, params)


def _integer_root(value: int, n: int) -> int:
    root = int(round(value ** (1.0 / n)))
    while root**n > value:
        root -= 1
    while (root + 1) ** n <= value:
        root += 1
    return root


def max_stripe_index_for_token_pos(
    token_pos: int, *, search_power: float | None = None, inv_search_power_int: int | None = 2
) -> int:
    """Largest stripe index i with floor(i ** (1/p)) <= token_pos."""
    token_pos = check_non_negative_int("token_pos", token_pos)
    if token_pos >= MAX_POSITION:
        raise ValueError(f"token_pos must be < 2**62, got {token_pos}")
    params = power_params(search_power=search_power, inv_search_power_int=inv_search_power_int)
    if params.integer_path:
        return _integer_root(token_pos, params.inv_int)
    guess = max(int(token_pos**params.p), 0)
    candidates = np.arange(max(guess - 2, 0), guess + 4)
    powers = floor_powers(candidates, params.inv_p)
    # floor(i ** inv_p) is increasing in i, so the answer is the last candidate that fits.
    fits = candidates[powers <= token_pos]
    if fits.size == 0 or fits[-1] == candidates[-1]:  # pragma: no cover - guard for wild guesses
        raise ArithmeticError(f"stripe search failed for token_pos={token_pos}")
    return int(fits[-1])


@functools.lru_cache(maxsize=256)
def stripe_count(key_length: int, sw_index: int, params: PowerParams) -> int:
    """S of semantics section 3: max(largest stripe index for key_length, sw_index + 1).

    Raises ValueError naming sw_index when its window exceeds 2**62 keys (``window_length``).
    """
    window_length(sw_index, params)
    if params.integer_path:
        largest = _integer_root(key_length, params.inv_int)
    else:
        largest = max_stripe_index_for_token_pos(key_length, search_power=params.p, inv_search_power_int=None)
    return max(largest, sw_index + 1)


def stripe_offsets(key_length: int, sw_index: int, params: PowerParams) -> np.ndarray:
    """floor(i ** (1/p)) for the decode stripes i = sw_index + 1 .. S (sized from key_length)."""
    exponent = float(params.inv_int) if params.integer_path else params.inv_p
    return floor_powers(np.arange(sw_index + 1, stripe_count(key_length, sw_index, params) + 1), exponent)


_TABLES: dict[tuple, torch.Tensor] = {}
_TABLES_LOCK = threading.Lock()


def _cached_device_table(key: tuple, device: torch.device, build) -> torch.Tensor:
    """A host-built int64 table, copied to ``device`` once and reused (no copy on later calls)."""
    full_key = (*key, str(device))
    table = _TABLES.get(full_key)
    if table is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "superlinear_ops: a geometry table for this shape was first needed inside CUDA graph "
                "capture; run the op once eagerly (or superlinear_ops warm-up) before capturing"
            )
        with _TABLES_LOCK:
            table = _TABLES.get(full_key)
            if table is None:
                table = torch.from_numpy(np.ascontiguousarray(build(), dtype=np.int64)).to(device)
                _TABLES[full_key] = table
    return table


def stripe_offsets_tensor(key_length: int, sw_index: int, params: PowerParams, device: torch.device) -> torch.Tensor:
    """``stripe_offsets`` as a cached int64 tensor on ``device``."""
    return _cached_device_table(
        ("stripes", key_length, sw_index, params),
        device,
        lambda: stripe_offsets(key_length, sw_index, params),
    )


def span_length_table(factor: float, span_power: float, max_base: int, device: torch.device) -> torch.Tensor:
    """int64 tensor L with L[d] = min(ceil(factor * d ** span_power), max_base) for d = 0 .. max_base,
    cached. The clamp is exact for spans over ``max_base`` keys (a span that long reaches past every
    key either way) and keeps huge factors from producing huge grids."""
    return _cached_device_table(
        ("span_len", float(factor), float(span_power), max_base),
        device,
        lambda: np.minimum(ceil_scaled_powers(factor, np.arange(max_base + 1), span_power), max_base),
    )


def span_distances(
    batch: int,
    cache_position: torch.Tensor,
    key_length: int,
    attention_mask: torch.Tensor | None,
    table_length: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pos [Lq], s [B], t - s [B, Lq]) for span lengths: pos = cache_position clamped to the keys,
    s the first key the mask allows in each row (0 without a mask), t = pos + 1; the distance is
    clamped to [0, table_length]. Tensor ops only, no sync."""
    device = cache_position.device
    pos = cache_position.to(torch.int64).clamp(0, key_length - 1)
    if attention_mask is not None:
        first_allowed = (attention_mask[:, :key_length] != 0).to(torch.int8).argmax(dim=1)
    else:
        first_allowed = torch.zeros(batch, dtype=torch.int64, device=device)
    return pos, first_allowed, (pos[None, :] + 1 - first_allowed[:, None]).clamp(0, table_length)


def span_starts(
    qanchor: torch.Tensor,
    cache_position: torch.Tensor,
    key_length: int,
    attention_mask: torch.Tensor | None,
    backward_factor: float,
    span_power: float,
) -> torch.Tensor:
    """Whole-layer span starts max(anchor - ceil(bf * (t - s) ** span_power), s) for anchors
    [B, H, Lq, K] (semantics section 4, step 2); -1 where the anchor is -1. Tensor ops only, no sync."""
    _, first_allowed, distance = span_distances(qanchor.shape[0], cache_position, key_length, attention_mask, key_length)
    back_len = span_length_table(backward_factor, span_power, key_length, qanchor.device)[distance]  # [B, Lq]
    qstart = torch.maximum(qanchor.to(torch.int64) - back_len[:, None, :, None], first_allowed.view(-1, 1, 1, 1))
    return torch.where(qanchor < 0, torch.full_like(qstart, -1), qstart)


def span_ends(
    qanchor: torch.Tensor,
    cache_position: torch.Tensor,
    key_length: int,
    window: int,
    attention_mask: torch.Tensor | None,
    forward_factor: float,
    span_power: float,
    table_length: int | None = None,
) -> torch.Tensor:
    """qend for checked arguments (see ``compute_qend_from_qanchor``); tensor ops only, no sync.

    The span-length table covers distances up to ``table_length`` (default ``key_length``): give a
    smaller bound when no position can reach further.
    """
    if forward_factor == 0.0:
        return qanchor
    device = qanchor.device
    table_length = key_length if table_length is None else table_length
    pos, _, distance = span_distances(qanchor.shape[0], cache_position.to(device), key_length, attention_mask, table_length)
    forward_len = span_length_table(forward_factor, span_power, table_length, device)[distance]
    qend = qanchor.to(torch.int64) + forward_len[:, None, :, None]
    limit = pos if window == 0 else pos - window
    qend = torch.minimum(qend, limit.view(1, 1, -1, 1))
    qend = torch.where(qanchor < 0, torch.full_like(qend, -1), qend)
    return qend.to(qanchor.dtype)


def compute_qend_from_qanchor(
    qanchor: torch.Tensor,
    *,
    cache_position: torch.Tensor,
    key_length: int,
    sw_index: int = 0,
    attention_mask: torch.Tensor | None = None,
    forward_factor: float = 0.0,
    span_power: float = 0.5,
    search_power: float | None = None,
    inv_search_power_int: int | None = 2,
) -> torch.Tensor:
    """Span ends for anchors [B, H, Lq, K] (semantics section 3, step 3); -1 where the anchor is -1.

    qend = anchor when forward_factor is 0, else
    min(anchor + ceil(ff * (t - s) ** span_power), pos, key_length - 1, pos - W [W > 0]),
    with pos = min(cache_position, key_length - 1), t = pos + 1 and s the first key the mask allows.
    Reads max(cache_position) on the host (it sizes the span-length table). qanchor and
    cache_position must be int32/int64, the mask bool or integer; key_length at most 2**62.
    """
    for name, t in (("qanchor", qanchor), ("cache_position", cache_position)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in (torch.int32, torch.int64):  # narrower types would wrap the span ends
            raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if qanchor.dim() != 4:
        raise ValueError(f"qanchor must be 4-D [B, H, Lq, K], got shape {tuple(qanchor.shape)}")
    if cache_position.dim() != 1:
        raise ValueError(f"cache_position must be a 1-D tensor [Lq], got shape {tuple(cache_position.shape)}")
    if cache_position.numel() != qanchor.shape[2]:
        raise ValueError(
            f"cache_position has {cache_position.numel()} entries but qanchor has Lq = {qanchor.shape[2]}"
        )
    key_length = check_non_negative_int("key_length", key_length)
    if not 0 < key_length <= MAX_POSITION:
        raise ValueError(f"key_length must be in [1, 2**62], got {key_length}")
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor or None, got {type(attention_mask).__name__}")
    if attention_mask is not None:
        check_mask_dtype(attention_mask)
    if attention_mask is not None and (
        attention_mask.dim() != 2
        or attention_mask.shape[0] != qanchor.shape[0]
        or attention_mask.shape[1] < key_length
    ):
        raise ValueError(
            f"attention_mask must be [B={qanchor.shape[0]}, >= {key_length}], got {tuple(attention_mask.shape)}"
        )
    window = window_len_from_sw_index(
        sw_index, search_power=search_power, inv_search_power_int=inv_search_power_int
    )
    # The table needs distances up to the furthest position only (one host read of the positions).
    furthest = int(cache_position.max()) + 1 if cache_position.numel() else 0
    return span_ends(
        qanchor,
        cache_position,
        key_length,
        window,
        attention_mask,
        check_factor("forward_factor", forward_factor, allow_zero=True),
        check_span_power(span_power),
        table_length=min(max(furthest, 0), key_length),
    )
