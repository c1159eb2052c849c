"""The mutant catalogue: realistic broken SP implementations the default suite must kill."""

from cases.mutants import megatron_mutants  # noqa: F401
from cases.mutants import dtensor_mutants  # noqa: F401
from cases.mutants import memory_mutants  # noqa: F401
from cases.mutants import clip_mutants  # noqa: F401
