"""Torchtitan's models and parallelisms: the integration's stable import surface.

The names users import (the case factories, the step configs) are re-exported here, so that a
user's case file imports `from sp_harness.cases.frameworks.torchtitan import ...` whichever module of the
package holds them today (docs/frameworks/README.md: one package per framework, the same file names
in each). Importing it imports no framework code.
"""

from __future__ import annotations

from sp_harness.cases.frameworks.torchtitan.case import (
    CP_STEP,
    TORCHTITAN_VERSION,
    cpu_shims,
    llama3_config,
    model_config,
    preload,
    registry_models,
    retie,
    torchtitan_case,
    torchtitan_cp_shard,
    torchtitan_shard,
    torchtitan_spmd_shard,
)
from sp_harness.cases.frameworks.torchtitan.step import TitanStepConfig, titan_step_shard, titan_train_case

__all__ = ['CP_STEP', 'TORCHTITAN_VERSION', 'TitanStepConfig', 'cpu_shims', 'llama3_config', 'model_config', 'preload', 'registry_models', 'retie', 'titan_step_shard', 'titan_train_case', 'torchtitan_case', 'torchtitan_cp_shard', 'torchtitan_shard', 'torchtitan_spmd_shard']
