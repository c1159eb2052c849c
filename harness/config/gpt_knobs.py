"""Stage: config. The knobs of the GPT-style cases (megatron, ulysses, ring, usp, torch_cp, the
framework integrations): model shape, attention, context-parallel placement, norm and layout.

A case names the knob dataclass it reads (`Case.knobs`); `CheckConfig` carries every knob class's
fields flat (one record, `config.hidden` as before), and the flags, help, valid values and
hypothesis draws come from the declarations here (sp_harness.config.flags, .strategies). This
file lives in the engine's config stage, not beside the cases, because `CheckConfig` is built
from it and the engine never imports a case.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

from sp_harness.config.flags import check_values, knob

Norm = Literal["layernorm", "rmsnorm"]
Layout = Literal["bsh", "sbh"]
LoadBalancer = Literal["none", "zigzag"]
NORMS: tuple[str, ...] = typing.get_args(Norm)
LAYOUTS: tuple[str, ...] = typing.get_args(Layout)
LOAD_BALANCERS: tuple[str, ...] = typing.get_args(LoadBalancer)


@dataclass(kw_only=True, frozen=True)
class GPTKnobs:
    """Every field None by default: the case's default fills it (`Case.defaults`), else the
    engine's (`ENGINE_DEFAULTS`)."""

    hidden: int | None = knob(min=1)
    """Model width. None: the case's default."""
    ffn: int | None = knob(min=1)
    """MLP inner width. None: the case's default."""
    num_heads: int | None = knob(min=1)
    """Attention heads. None: the case's default."""
    num_kv_heads: int | None = knob(min=1)
    """Key/value heads, grouped-query attention: fewer than num_heads, dividing it. None: the
    case's default, else num-heads."""
    causal: bool | None = None
    """Causal attention (yes) or full bidirectional attention (no). None: the case's default."""
    load_balancer: LoadBalancer | None = None
    """How a context-parallel case places sequence chunks: 'none' (contiguous shards) or 'zigzag'
    (2W chunks, rank i holds chunks i and 2W-1-i). None: the case's default."""
    ring_degree: int | None = knob(min=1)
    """For a hybrid Ulysses x ring case: ranks in each ring (the Ulysses degree is tp /
    ring-degree). None: the case's default."""
    prompt_len: int | None = knob(min=0)
    """Leading tokens of every sequence whose targets carry no loss (label -100, the prompt of a
    fine-tuning sample): a rank holding only prompt tokens has no target tokens, and the loss is
    normalised by the targets that count. Must be < seq-len. None: the case's default."""
    num_layers: int | None = knob(min=1)
    """Transformer blocks. None: the case's default."""
    vocab: int | None = knob(min=1)
    """Vocabulary size. None: the case's default."""
    norm: Norm | None = None
    """The norm of cases that have one. None: the case's default."""
    layout: Layout | None = None
    """Activation layout for cases that support both: 'bsh' ([b, s, h], GPT-NeoX) or 'sbh'
    ([s, b, h], Megatron). None: the case's default."""

    def __post_init__(self) -> None:
        check_values(self)
