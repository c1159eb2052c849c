"""Moved to `sp_harness.cases.frameworks.torchtitan.cases`; this path is kept for case files written against it."""

from __future__ import annotations

from sp_harness.cases.frameworks.torchtitan.cases import embedding_partial_declared_replicate

__all__ = ["embedding_partial_declared_replicate"]
