"""Stage: step. TRL's releases: the range this integration supports, asked as capabilities
(sp_harness.cases.frameworks.releases).

Importing it imports no framework code; `missing()` does (the driver asks it in a child
interpreter). The Trainer underneath is the HF integration's (sp_harness.cases.frameworks.hf.compat
names its range and its gaps); what TRL adds is asked here: `SFTConfig` with the fields the case
sets, `SFTTrainer._prepare_dataset` (the dataset preparation the feed runs on each step's rows)
and the fused LM head (`fused_lm_head=`, which TRL's loss and the user's SP fix call).
"""

from __future__ import annotations

import dataclasses
import inspect

from sp_harness.cases.frameworks.releases import ReleaseRange

RELEASES: tuple[ReleaseRange, ...] = (
    ReleaseRange(distribution="trl", oldest="1.16.0", newest="1.16.0",
                 note="the release the trl extra pins; its SP path needs accelerate >= 1.12 (ParallelismConfig's "
                      "sp_backend) and DeepSpeed (the hf and deepspeed extras)"),
)
"""Supported releases, both ends included: the one whose tests and cases ran (docs/frameworks/trl.md)."""

SFT_FIELDS = ("completion_only_loss", "pad_to_multiple_of", "packing", "max_length", "dataset_num_proc")
"""The SFTConfig fields the case sets (sp_harness.cases.frameworks.trl.case.SFTFlavour)."""


def missing() -> tuple[str, ...]:
    """What this integration calls that the installed TRL lacks, one item each; () where none."""
    try:
        from trl import SFTConfig, SFTTrainer
        from trl.trainer import utils
    except ImportError as error:
        return (f"trl importable ({error})",)
    gaps = []
    have = {f.name for f in dataclasses.fields(SFTConfig)}
    gaps += [f"SFTConfig({name}=)" for name in SFT_FIELDS if name not in have]
    prepare = getattr(SFTTrainer, "_prepare_dataset", None)
    if prepare is None or list(inspect.signature(prepare).parameters)[1:] != [
            "dataset", "processing_class", "args", "packing", "formatting_func", "dataset_name"]:
        gaps.append("SFTTrainer._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)")
    if not hasattr(utils, "add_fused_lm_head"):
        gaps.append("trl.trainer.utils.add_fused_lm_head (the fused LM head SFTTrainer's loss runs)")
    return tuple(gaps)


__all__ = ["RELEASES", "SFT_FIELDS", "missing"]
