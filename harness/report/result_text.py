"""Stage: report. The side-by-side verdict's text: `format_result` renders a `CheckResult` (the
figures of the side-by-side and training-step checks, sp_harness.judge.verdict) as its table,
`format_comm` its collective rows. The one rendering of that type: `format_outcomes`
(sp_harness.report.text) applies it before asking a check to render its own figures.
"""

from __future__ import annotations

from sp_harness.capture.comm import CommRow
from sp_harness.capture.islands import DECLARED, summary
from sp_harness.compare.divergence import Divergence
from sp_harness.compare.tensor_check import KIND_ORDER
from sp_harness.judge.verdict import ERROR, FAIL, UNSUPPORTED, CheckResult


def _encloses(module: str, divergence: Divergence | None) -> bool:
    """Whether the first diverging module is `module`, inside it, or holds it."""
    if divergence is None or not divergence.module:
        return False
    found = divergence.module
    return found == module or found.startswith(module + ".") or module.startswith(found + ".")


RATIO_LEGEND = ("(ratio: the worst element's error over its own bound, `allowed` that element's bound, while `max abs "
                "err` is the tensor's largest error, wherever it is; piece: the whole piece's error norm over its "
                "bound; above 1 fails)")
"""Under the table: `ratio` is not `max abs err` / `allowed` (each element has its own bound)."""


def format_result(res: CheckResult, *, verbose: bool = False) -> str:
    """The human verdict table for one check."""
    cfg = res.config
    lines = [f"case {cfg.case}  [{cfg.short()}]  tp={cfg.tp} dp={cfg.dp}  {res.wall_s:.2f}s"]
    if res.verdict == UNSUPPORTED:
        lines.append(f"UNSUPPORTED: {res.reason}")
        return "\n".join(lines)
    if res.verdict == ERROR:
        # nothing of the code under test ran: its numbers were never judged
        lines.append("ERROR: " + res.reason)
        if res.error:
            lines.append(res.error if verbose else _tail(res.error, 25))
        lines.append(f"repro: {cfg.repro()}")
        return "\n".join(lines)
    if res.error:
        lines.append("FAIL: " + res.reason)
        lines.append(res.error if verbose else _tail(res.error, 25))
        lines.append(f"repro: {cfg.repro()}")
        return "\n".join(lines)
    # `piece`: the worst whole-piece ratio (norm-wise; a bf16 param's update scale), which can
    # fail a check whose every element is within its own bound
    lines.append(f"{'check':<11} {'worst tensor':<34} {'max abs err':>12} {'allowed':>11} {'ratio':>9} {'piece':>7}  result")
    for kind in KIND_ORDER:
        chk = res.worst.get(kind)
        if chk is None:
            continue
        whole = res.worst_norm.get(kind)
        piece = f"{whole.norm_ratio:>7.3g}" if whole is not None else f"{'-':>7}"
        bad = [f for f in res.failures if f.kind == kind]
        status = "ok" if not bad else f"FAIL ({len({(f.step, f.name) for f in bad})} tensor-steps)"
        lines.append(f"{kind:<11} {chk.name[:34]:<34} {chk.max_abs:>12.3g} {chk.allowed:>11.3g} {chk.ratio:>9.3g} {piece}  {status}")
    drift_status = "ok (bit-identical)" if not res.drift else f"FAIL ({len(res.drift)})"
    lines.append(f"{'replicas':<11} {'replicated params across ranks':<34} {max((d.max_abs for d in res.drift), default=0.0):>12.3g} {0.0:>11.3g} {'':>9} {'':>7}  {drift_status}")
    lines.append(RATIO_LEGEND)
    if res.losses:
        lines.append("loss per step: " + " ".join(f"{x:.6f}" for x in res.losses))
    if res.verdict == FAIL:
        lines.append(f"FAIL: first failure: {res.first_failure}")
        # right after it: a reader sees the low-precision ops as candidate causes: an op found
        # below the run dtype where it could have caused the first divergence (not after a
        # forward one: a later module, backward, the loss), and a declared island only where
        # localisation placed the failure in or around its module (the references model a
        # declared one, so elsewhere it is noise)
        div = res.divergence
        candidates = [i for i in res.islands
                      if (_encloses(i.module, div) if i.op == DECLARED
                          else div is None or div.could_cause(i.module, backward=i.where == "backward"))]
        if candidates:
            lines.append(summary(candidates, str(cfg.dtype), "candidate cause, precision islands"))
        if res.grad_factor is not None:
            # the JSON's grad_factor, set only where one factor fits every param grad
            lines.append(f"every param grad is {res.grad_factor:.3f}x the reference's (one factor fits them all): "
                         f"a loss normalisation or averaging error")
        if res.divergence is not None:
            lines.append(res.divergence.describe())
        names = res.failing_names
        lines.append(f"failing at that step: {', '.join(names[:12])}{' ...' if len(names) > 12 else ''}")
        shown = res.failures[: (50 if verbose else 8)]
        for f in shown:
            lines.append("  " + f.describe())
        for d in res.drift[: (50 if verbose else 4)]:
            lines.append("  " + d.describe())
        lines.append(f"repro: {cfg.repro()}")
    else:
        lines.append(f"PASS ({res.num_checks} tensor checks over {cfg.steps} step(s), all ranks)")
        if res.islands:
            lines.append(summary(res.islands, str(cfg.dtype)))
    if res.not_judged:
        lines.append(f"forward only: not judged: {', '.join(res.not_judged)}")
    for why in res.not_run:
        lines.append(f"not run: {why}")
    for finding in res.findings:
        lines.append(f"finding (mapped by shape, judged): {finding}")
    if res.vacuous:
        shown = res.vacuous[: (50 if verbose else 6)]
        more = f" and {len(res.vacuous) - len(shown)} more" if len(res.vacuous) > len(shown) else ""
        pieces = ", ".join(f"{c.kind} {c.name} (step {c.step}: {c.vacuous:.3g}x)" for c in shown)
        lines.append(f"not judged in {cfg.dtype}, their bounds would pass a zero tensor (the bound over the tensor's "
                     f"size): {pieces}{more}")
    return "\n".join(lines)


def _tail(text: str, n: int) -> str:
    rows = text.splitlines()
    return "\n".join(rows if len(rows) <= n else ["  ..."] + rows[-n:])


def format_comm(rows: list[CommRow]) -> str:
    if not rows:
        return "collectives per step (rank 0): none"
    lines = ["collectives per step (rank 0):", f"  {'phase':<10} {'kind':<15} {'group':<7} {'count':>5} {'bytes':>10}"]
    for r in rows:
        lines.append(f"  {r.phase:<10} {r.kind:<15} {r.group:<7} {r.count:>5} {r.bytes:>10}")
    return "\n".join(lines)
