"""TRL's `SFTTrainer` as a system under test: its own dataset preparation, collator, fused-LM-head
loss and completion-only masks inside the transformers Trainer's loop (sp_harness.cases.frameworks.hf),
under DDP and under accelerate's sequence parallelism (DeepSpeed Ulysses). `pip install sp-harness[trl]`."""

from sp_harness.cases.frameworks.trl.case import SFTFlavour, SFTSetup, sft_trainer_case

__all__ = ["SFTFlavour", "SFTSetup", "sft_trainer_case"]
