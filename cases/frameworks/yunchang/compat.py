"""Stage: step. yunchang's releases: the range this integration supports and what differs
inside it, asked as capabilities (sp_harness.cases.frameworks.releases).

Everything else in the package asks this module, never a version string. Importing it imports no
framework code; `missing()` and `attn_type_enum()` do (the driver asks `missing()` in a child
interpreter, through the CPU import shim: yunchang_shims.import_yunchang).

What differs inside the range (docs/frameworks/yunchang.md, "Releases"):
- the attention-type enum is `AttnType` from 0.6.0, `FlashAttentionImpl` before (values fa, fa3,
  torch); its values grow release by release (`attn_type_enum`);
- 0.6.2 and 0.6.3.post1 probe the CUDA arch at import, 0.5.0 to 0.6.3.post1 the GPU's name in
  `UlyssesAttention.__init__`: CPU shims answer both as a GPU would (yunchang_shims);
- 0.6.3 does not import anywhere (its `AttnType` defines SAGE_FP16_TRITON twice: a TypeError
  on every Python), which `missing()` reports: UNSUPPORTED, with the reason.
"""

from __future__ import annotations

import inspect
from typing import Any

from sp_harness.cases.frameworks.releases import ReleaseRange

RELEASES: tuple[ReleaseRange, ...] = (
    ReleaseRange(distribution="yunchang", oldest="0.5.0", newest="0.6.4", note="0.6.3 does not import: 0.6.3.post1 does"),
)
"""Supported releases, both ends included: each one's framework tests pass (docs/frameworks/
yunchang.md, "Releases"; the release matrix: tox -m releases-yunchang)."""

RING_IMPLS = ("basic", "zigzag", "strip")
"""The ring implementations the cases run (`RING_IMPL_DICT` and `EXTRACT_FUNC_DICT` keys)."""


def attn_type_enum() -> Any:
    """yunchang's enum of attention types: `yunchang.kernels.AttnType`, or `FlashAttentionImpl`,
    its name before 0.6.0 (the same members FA, FA3, TORCH). Imports yunchang."""
    from sp_harness.cases.frameworks.yunchang.shims import import_yunchang

    import_yunchang()
    import yunchang.kernels as kernels

    enum = getattr(kernels, "AttnType", None) or getattr(kernels, "FlashAttentionImpl", None)
    if enum is None:
        raise ImportError("yunchang.kernels has neither AttnType nor FlashAttentionImpl (its attention-type enum)")
    return enum


def _params(fn: Any) -> set[str]:
    return set(inspect.signature(fn).parameters)


def missing() -> tuple[str, ...]:
    """Each API this integration needs that the installed release lacks, named as a user would
    look it up."""
    from sp_harness.cases.frameworks.yunchang.shims import import_yunchang

    import_yunchang()
    import yunchang
    import yunchang.globals as globals_
    import yunchang.kernels as kernels

    gaps = []
    try:
        attn_type_enum()
    except ImportError as exc:
        gaps.append(str(exc))
    set_pg = getattr(globals_, "set_seq_parallel_pg", None)
    if set_pg is None or "use_ulysses_low" not in _params(set_pg):
        gaps.append("yunchang.globals.set_seq_parallel_pg(..., use_ulysses_low=)")
    group = getattr(globals_, "PROCESS_GROUP", None)
    if group is None or not all(hasattr(group, g) for g in ("ULYSSES_PG", "RING_PG")):
        gaps.append("yunchang.globals.PROCESS_GROUP.ULYSSES_PG / RING_PG")
    for layer, params in (("LongContextAttention", {"ring_impl_type", "attn_type"}),
                          ("UlyssesAttention", {"sequence_process_group", "attn_type"})):
        cls = getattr(yunchang, layer, None)
        if cls is None or not params <= _params(cls.__init__):
            gaps.append(f"yunchang.{layer}({', '.join(f'{p}=' for p in sorted(params))})")
    extract = getattr(yunchang, "EXTRACT_FUNC_DICT", {})
    gaps += [f"yunchang.EXTRACT_FUNC_DICT[{impl!r}]" for impl in RING_IMPLS if impl not in extract]
    from yunchang.hybrid import utils as hybrid_utils

    rings = getattr(hybrid_utils, "RING_IMPL_DICT", {})
    gaps += [f"yunchang.hybrid.utils.RING_IMPL_DICT[{impl!r}]" for impl in RING_IMPLS if impl not in rings]
    from yunchang.ring import utils as ring_utils

    if not hasattr(ring_utils, "update_out_and_lse"):
        gaps.append("yunchang.ring.utils.update_out_and_lse (the ring's LSE merge)")
    for name in ("select_flash_attn_impl",):
        if not hasattr(kernels, name):
            gaps.append(f"yunchang.kernels.{name}")
    attention = getattr(kernels, "attention", None)
    if attention is None or not all(hasattr(attention, f) for f in ("flash_attn_forward", "flash_attn_backward")):
        gaps.append("yunchang.kernels.attention.flash_attn_forward / flash_attn_backward (its FA ring kernels)")
    from yunchang.comm import all_to_all

    if not hasattr(all_to_all, "SeqAllToAll4D"):
        gaps.append("yunchang.comm.all_to_all.SeqAllToAll4D")
    return tuple(gaps)
