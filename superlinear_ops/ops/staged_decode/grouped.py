"""Staged decode with the stripe search and the window computed once per KV group on tensor
cores: the chosen spans in chunks per head after the search, merged by the last program
(``grouped_decode``; ``grouped_kernels``), or every stripe's span per group beside the search and a
merge launch that picks the chosen ones (``stripe_spans_decode``; ``stripe_spans_kernels``), or
the chosen spans of all the group's heads per chunk of key positions, each key read once for the
group, and a merge launch per head (``group_spans_decode``; ``group_spans_kernels``), or search,
spans, window and gate per KV group with its keys split over programs, merged by the last program
(``one_launch_decode``) or by a merge launch per head (``split_merge_decode``; both in
``split_keys_kernels``). All take (q1, q2, k, v, cache_position, attention_mask, settings, config)
of validated inputs and return the output [B, Hq, 1, D] with no host synchronisation."""

from __future__ import annotations

from functools import partial

import torch

from ...launch import KernelConfig
from ...settings import SpanSettings
from .tables import decode_tables


def _two_launch_decode(
    q1: torch.Tensor,
    q2: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_position: torch.Tensor,
    attention_mask: torch.Tensor | None,
    settings: SpanSettings,
    config: KernelConfig,
    *,
    stripe_spans: bool,
) -> torch.Tensor:
    """``grouped_decode_attention`` given the shape's tables and the config's tiles."""
    from .grouped_kernels import grouped_decode_attention  # imports Triton on first use only

    settings = settings.for_keys(k.shape[2])
    tables = decode_tables(k.shape[2], settings, q1.device)
    return grouped_decode_attention(
        q1, q2, k, v, cache_position, attention_mask, tables.offsets, tables.back, tables.forward,
        settings.window_for(k.shape[2]), settings.topk, tables.longest_span,
        block_k=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages, chunk=config.chunk,
        stripe_spans=stripe_spans,
    )


grouped_decode = partial(_two_launch_decode, stripe_spans=False)
stripe_spans_decode = partial(_two_launch_decode, stripe_spans=True)


def _launch_with_tables(attention, q1, q2, k, v, cache_position, attention_mask, settings: SpanSettings,
                        config: KernelConfig) -> torch.Tensor:
    """``attention`` (``group_spans_attention``, ``one_launch_attention`` or ``split_merge_attention``)
    given the shape's tables and the config's tiles."""
    settings = settings.for_keys(k.shape[2])
    tables = decode_tables(k.shape[2], settings, q1.device)
    return attention(
        q1, q2, k, v, cache_position, attention_mask, tables.offsets, tables.back, tables.forward,
        settings.window_for(k.shape[2]), settings.topk, tables.longest_span,
        block_k=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages, chunk=config.chunk,
    )


def group_spans_decode(q1: torch.Tensor, q2: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       cache_position: torch.Tensor, attention_mask: torch.Tensor | None, settings: SpanSettings,
                       config: KernelConfig) -> torch.Tensor:
    """The chosen spans' keys read once per KV group (``group_spans_attention``)."""
    from .group_spans_kernels import group_spans_attention  # imports Triton on first use only

    return _launch_with_tables(group_spans_attention, q1, q2, k, v, cache_position, attention_mask, settings, config)


def one_launch_decode(q1: torch.Tensor, q2: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cache_position: torch.Tensor, attention_mask: torch.Tensor | None, settings: SpanSettings,
                      config: KernelConfig) -> torch.Tensor:
    """Search, spans, window and gate per KV group in one launch (``one_launch_attention``)."""
    from .split_keys_kernels import one_launch_attention  # imports Triton on first use only

    return _launch_with_tables(one_launch_attention, q1, q2, k, v, cache_position, attention_mask, settings, config)


def split_merge_decode(q1: torch.Tensor, q2: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       cache_position: torch.Tensor, attention_mask: torch.Tensor | None, settings: SpanSettings,
                       config: KernelConfig) -> torch.Tensor:
    """``one_launch_decode``'s splits merged by a second launch, one program per head (``split_merge_attention``)."""
    from .split_keys_kernels import split_merge_attention  # imports Triton on first use only

    return _launch_with_tables(split_merge_attention, q1, q2, k, v, cache_position, attention_mask, settings, config)
