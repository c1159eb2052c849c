"""The Hugging Face Trainer's own training step (transformers + accelerate): the integration's stable import surface.

The names users import (the case factories, the step configs) are re-exported here, so that a
user's case file imports `from sp_harness.cases.frameworks.hf import ...` whichever module of the
package holds them today (docs/frameworks/README.md: one package per framework, the same file names
in each). Importing it imports no framework code.
"""

from __future__ import annotations

from sp_harness.cases.frameworks.hf.case import HFTrainerSetup, hf_trainer_case, hf_trainer_shard

__all__ = ['HFTrainerSetup', 'hf_trainer_case', 'hf_trainer_shard']
