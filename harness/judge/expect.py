"""Stage: judge. For generated configs: the verdict a case should reach on a config.

Cases declare it: `Case.validate` says what is UNSUPPORTED up front, `Case.expect` pins upstream
behaviour where a case wraps someone else's code (PyTorch's DTensor styles fail on uneven splits
in torch 2.13; measured and recorded in docs/findings.md); every other case must
PASS. If PyTorch changes, the property tests say so.
"""

from __future__ import annotations

from sp_harness.config.case import Unsupported
from sp_harness.config.check_config import CheckConfig
from sp_harness.config.registry import get_case


def expected_verdict(config: CheckConfig) -> str:
    case = get_case(config.case)
    config = case.resolve(config)
    try:
        case.validate(config)
    except Unsupported:
        return "UNSUPPORTED"
    return case.expect(config) if case.expect is not None else "PASS"
