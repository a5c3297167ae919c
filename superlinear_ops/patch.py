"""Route models written against the original ``superlinear`` 0.1.0 package to these ops.

``patch_superlinear()`` replaces the original's public span and layer functions, on every public
module that binds them, with this package's functions; ``unpatch_superlinear()`` puts the
originals back. Neither imports the original (nor Triton) before it is called.
"""

from __future__ import annotations

import importlib
import logging
import threading
from types import ModuleType

log = logging.getLogger("superlinear_ops")

# The original's public modules that bind the replaced names: the defining api modules and the
# packages that re-export them (the top-level package re-exports most of them too).
TARGET_MODULES = (
    "superlinear.kernels.superlinear.span.api",
    "superlinear.kernels.superlinear.span",
    "superlinear.kernels.superlinear.attention.api",
    "superlinear.kernels.superlinear.attention",
    "superlinear",
)

SPAN_NAMES = (
    "fused_span_attention",
    "fused_span_attention_gqa",
    "span_attention",
    "span_attention_gqa",
    "decode_span_attention_staged",
    "decode_span_attention_staged_gqa",
    "decode_span_attention",
    "decode_span_attention_gqa",
)
LAYER_NAMES = (
    "prefill",
    "prefill_gqa",
    "prefill_mha",
    "fused_prefill_with_swtriton_gqa",
    "fused_prefill_with_swtriton",
    "fused_prefill_with_swtriton_bucketed_gqa",
)

# Our module that serves each replaced name (the same name there).
REPLACEMENTS = {
    **{name: "superlinear_ops.api" for name in SPAN_NAMES},
    **{name: "superlinear_ops.layer_api" for name in LAYER_NAMES},
}

_lock = threading.Lock()
# "module.attr" -> (the module object, attr, the original's function): what unpatch restores.
_originals: dict[str, tuple[ModuleType, str, object]] = {}


def _import_original() -> ModuleType | None:
    """The original top-level package, or None (with a log line saying why) when it cannot be imported."""
    try:
        return importlib.import_module("superlinear")
    except ImportError as error:
        if error.name == "superlinear":
            log.info("superlinear is not installed: nothing patched")
        else:  # installed, but one of its imports (e.g. triton) fails: no model can use it either
            log.warning("superlinear is installed but cannot be imported (%s): nothing patched", error)
        return None


def patch_superlinear() -> dict[str, str]:
    """Replace the original ``superlinear`` package's public span and layer functions with ours.

    Returns ``{"module.attr": "superlinear_ops.<module>.<function>"}`` for every name replaced
    ({} when the original is not installed or cannot be imported). Idempotent; ``unpatch_superlinear``
    undoes it.

    Only the original's module attributes change: code that ran ``from superlinear... import f``
    before this call keeps its own binding to the original ``f``, so call ``patch_superlinear()``
    before importing model code. The original's aliases that look their target up at call time
    (``decode_attention``, ``prefill_bucketed``, ...) reach ours too; its other functions (the
    flex prefill paths, ``build_sw_blockmask``, search) and its private modules stay as they are.
    """
    original = _import_original()
    if original is None:
        return {}
    with _lock:
        ours = {module: importlib.import_module(module) for module in dict.fromkeys(REPLACEMENTS.values())}
        for module_name in TARGET_MODULES:
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as error:
                if error.name != module_name:
                    raise
                continue  # not in this version of the original
            for name, our_module in REPLACEMENTS.items():
                current = getattr(module, name, None)
                if not callable(current):
                    continue
                key = f"{module_name}.{name}"
                _originals.setdefault(key, (module, name, current))
                setattr(module, name, getattr(ours[our_module], name))
        replaced = {key: REPLACEMENTS[name] + "." + name for key, (_, name, _) in _originals.items()}
    if replaced:
        log.info("patched superlinear with superlinear_ops: %s", ", ".join(f"{k} -> {v}" for k, v in replaced.items()))
    else:
        log.info("superlinear %s has none of the known public functions: nothing patched", getattr(original, "__version__", "?"))
    return replaced


def unpatch_superlinear() -> list[str]:
    """Put back the original functions ``patch_superlinear`` replaced; returns the names restored."""
    with _lock:
        restored = list(_originals)
        for module, name, original in _originals.values():
            setattr(module, name, original)
        _originals.clear()
    if restored:
        log.info("restored superlinear's originals: %s", ", ".join(restored))
    return restored
