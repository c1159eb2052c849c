"""The tolerance model's judgement of one tensor in the form the unit tests write it: each
reference as its own tensor and a run dtype, handed to `check_tensor` as one `RefPieces` and that
dtype's `Precision` record (looked up at the call, so a test may swap a record)."""

from sp_harness.compare.tolerance import RefPieces, check_tensor
from sp_harness.step.precision import precision_of


def judge(*, ref64, ref_lp, dtype, ref_alt=None, ref_samples=(), **rest):
    refs = RefPieces(r64=ref64, lp=ref_lp, alt=ref_alt, members=tuple(ref_samples))
    return check_tensor(refs=refs, precision=precision_of(dtype), **rest)
