"""Systems under test. Importing this package registers every built-in case, and the built-in
cases of every installed framework (sp_harness.cases.frameworks)."""

from sp_harness.cases import dtensor_plans, megatron, mutants, ring, torch_cp, ulysses, usp  # noqa: F401
from sp_harness.cases.frameworks import register_installed

register_installed()
