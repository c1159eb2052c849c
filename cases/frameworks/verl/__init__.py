"""verl's own SFT training step with Ulysses sequence parallelism: the integration's stable import surface.

The names users import (the case factory, its setup) are re-exported here, so that a user's case
file imports `from sp_harness.cases.frameworks.verl import ...` whichever module of the package
holds them today (docs/frameworks/README.md: one package per framework, the same file names in
each). Importing it imports no framework code.
"""

from __future__ import annotations

from sp_harness.cases.frameworks.verl.case import VerlSFTSetup, verl_sft_case, verl_sft_shard

__all__ = ['VerlSFTSetup', 'verl_sft_case', 'verl_sft_shard']
