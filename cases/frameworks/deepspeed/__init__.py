"""DeepSpeed's Ulysses (`deepspeed.sequence`) and its engine's step: the integration's stable import surface.

The names users import (the case factories, the step configs) are re-exported here, so that a
user's case file imports `from sp_harness.cases.frameworks.deepspeed import ...` whichever module of the
package holds them today (docs/frameworks/README.md: one package per framework, the same file names
in each). Importing it imports no framework code.
"""

from __future__ import annotations

from sp_harness.cases.frameworks.deepspeed.case import detached, ulysses_case, ulysses_shard
from sp_harness.cases.frameworks.deepspeed.hf import CausalLMLogits, hf_ulysses_case
from sp_harness.cases.frameworks.deepspeed.module import ulysses_module_case
from sp_harness.cases.frameworks.deepspeed.step import DeepSpeedStepConfig, ds_step_case, ds_step_shard

__all__ = ['CausalLMLogits', 'DeepSpeedStepConfig', 'detached', 'ds_step_case', 'ds_step_shard', 'hf_ulysses_case', 'ulysses_case', 'ulysses_module_case', 'ulysses_shard']
