"""Stage: record. The step-record schema and its JSONL / JSON files, read by report and gate.

A convergence run directory holds one `<run>.jsonl` per run (one JSON object per line, one line
per optimizer step) and one `meta.json` (case, config, mesh, optimizer, loss floor, and the
list of run names, so readers never glob for files).

Precision. Finite floats are written by `json`, which uses `float.__repr__`: the shortest
string that parses back to the same double, so every value round-trips bit for bit (a float32
value widened to a Python float is exact in a double too). Non-finite floats are not valid JSON;
rather than emit the non-standard `NaN` / `Infinity` tokens (which `jq`, browsers and most JSON
parsers reject) they are written as the strings "nan", "inf" and "-inf" and turned back into
floats on read. A diverged run therefore still produces a file every tool can parse, and its
NaN loss comes back as a NaN, not as a missing value. Files are written with allow_nan=False so
a non-finite float that slipped past the encoding fails loudly instead of writing bad JSON.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
"""Bumped when a StepRecord field changes meaning; stored in meta.json."""

META_FILE = "meta.json"

_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


@dataclass(kw_only=True)
class StepRecord:
    """What one run measured at one optimizer step."""

    run: str
    """Run name: 'ref' (single device), 'tp', 'sp', or any other label."""
    step: int
    """0-based optimizer step. `loss` and `grad_norm` are from this step's forward/backward,
    before its update; the drift and parameter-error fields are after its update."""
    loss: float
    """Global mean loss of the step (what the reference would compute on the same batch)."""
    grad_norm: float
    """Global L2 norm of the gradient before clipping, replicated parameters counted once."""
    lr: float
    """Learning rate used for this step's update."""
    replica_drift: dict[str, float] = field(default_factory=dict)
    """Reference parameter name -> max abs difference between the ranks' copies of that
    replicated parameter after the update. Empty for a single-device run."""
    max_replica_drift: float = 0.0
    """Max of `replica_drift` (0.0 when empty). Anything but 0.0 means replicas diverged."""
    param_err_vs_ref: float | None = None
    """max |param - reference param| over all parameters after the update; None if unmeasured
    (and for the reference itself)."""
    step_time_s: float = math.nan
    """Wall time of the step in seconds (forward, backward, update); NaN if unmeasured."""
    tokens_per_s: float = math.nan
    """Global tokens processed per second of `step_time_s`; NaN if unmeasured."""

    def __post_init__(self) -> None:
        if not isinstance(self.run, str) or not self.run:
            raise ValueError(f"run must be a non-empty string, got {self.run!r}")
        if isinstance(self.step, bool) or not isinstance(self.step, numbers.Integral):
            raise ValueError(f"step must be an int, got {self.step!r}")
        if self.step < 0:
            raise ValueError(f"step must be >= 0, got {self.step}")
        self.step = int(self.step)
        for name in ("loss", "grad_norm", "lr", "max_replica_drift", "step_time_s", "tokens_per_s"):
            setattr(self, name, _as_float(name, getattr(self, name)))
        if self.param_err_vs_ref is not None:
            self.param_err_vs_ref = _as_float("param_err_vs_ref", self.param_err_vs_ref)
        if not isinstance(self.replica_drift, Mapping):
            raise ValueError(f"replica_drift must be a dict name -> float, got {self.replica_drift!r}")
        self.replica_drift = {
            str(k): _as_float(f"replica_drift[{k!r}]", v) for k, v in self.replica_drift.items()
        }
        if self.replica_drift:
            worst = max(self.replica_drift.values(), key=_nan_is_largest)
            # the gate reads the max and names the parameter from the dict; a max that hides
            # a larger per-parameter value would make a real drift invisible
            if _nan_is_largest(worst) > _nan_is_largest(self.max_replica_drift):
                raise ValueError(
                    f"{self.run} step {self.step}: max_replica_drift={self.max_replica_drift!r} "
                    f"is below the largest replica_drift value {worst!r}"
                )

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON dict (non-finite floats as 'nan'/'inf'/'-inf' strings)."""
        return {f.name: json_safe(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "StepRecord":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(obj) - names)
        if unknown:
            raise ValueError(f"unknown StepRecord fields {unknown}; known: {sorted(names)}")
        # float fields decode 'nan'/'inf'/'-inf' themselves (in _as_float); other fields are
        # passed through untouched so a run named 'nan' stays a string
        return cls(**obj)


def write_records(path: str | os.PathLike, records: Iterable[StepRecord]) -> Path:
    """Write records as JSONL (one object per line), replacing the file atomically."""
    path = Path(path)
    lines = [json.dumps(r.to_json(), allow_nan=False) for r in records]
    _atomic_write(path, "".join(line + "\n" for line in lines))
    return path


def append_record(path: str | os.PathLike, record: StepRecord) -> None:
    """Append one record; lets a long run leave a readable prefix if it dies mid-way."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record.to_json(), allow_nan=False) + "\n")


def read_records(path: str | os.PathLike) -> list[StepRecord]:
    """Records of a JSONL file in file order; errors name the file and line."""
    path = Path(path)
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(StepRecord.from_json(json.loads(line)))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: bad step record: {e}") from e
    return out


def make_meta(
    *,
    case: str,
    config: Mapping[str, Any],
    world_size: int,
    dp: int,
    tp: int,
    optimizer: str,
    dtype: str,
    floor: float | None,
    runs: Sequence[str],
    **extra: Any,
) -> dict[str, Any]:
    """The run-metadata dict written to meta.json. `floor` is the data's entropy rate in nats
    (the ideal loss, see sp_harness.step.data) or None when the data has no known floor; `extra` keys
    (data description, git revision, host) are stored as given and must be JSON-serialisable."""
    if world_size != dp * tp:
        raise ValueError(f"world_size({world_size}) != dp({dp}) * tp({tp})")
    if not runs:
        raise ValueError("runs must name at least one run")
    return {
        "schema_version": SCHEMA_VERSION,
        "case": case,
        "config": dict(config),
        "world_size": world_size,
        "dp": dp,
        "tp": tp,
        "optimizer": optimizer,
        "dtype": dtype,
        "floor": floor,
        "runs": list(runs),
        **extra,
    }


def write_meta(path: str | os.PathLike, meta: Mapping[str, Any]) -> Path:
    """Write meta.json. Non-finite floats anywhere in it are stored as 'nan'/'inf' strings;
    `read_meta` turns `floor` back into a float (the only float field readers compute with)."""
    path = Path(path)
    _atomic_write(path, json.dumps(json_safe(dict(meta)), indent=2, allow_nan=False) + "\n")
    return path


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        meta = json.load(f)
    version = meta.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise ValueError(f"{path}: schema_version {version}, this harness reads {SCHEMA_VERSION}")
    if meta.get("floor") is not None:
        meta["floor"] = _decode(meta["floor"])
    return meta


def write_run_dir(
    out_dir: str | os.PathLike, runs: Mapping[str, Sequence[StepRecord]], meta: Mapping[str, Any]
) -> Path:
    """Write `<run>.jsonl` per run and meta.json (its `runs` set to these runs' names)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, records in runs.items():
        _check_run_name(name)
        bad = [r.run for r in records if r.run != name]
        if bad:
            raise ValueError(f"records under run {name!r} carry run names {sorted(set(bad))}")
        write_records(out_dir / f"{name}.jsonl", records)
    write_meta(out_dir / META_FILE, {**meta, "runs": list(runs)})
    return out_dir


def read_run_dir(run_dir: str | os.PathLike) -> tuple[dict[str, list[StepRecord]], dict[str, Any]]:
    """(runs by name, meta) from a directory written by `write_run_dir` (or a runner)."""
    run_dir = Path(run_dir)
    meta = read_meta(run_dir / META_FILE)
    runs = {name: read_records(run_dir / f"{name}.jsonl") for name in meta["runs"]}
    return runs, meta


def series(records: Sequence[StepRecord], metric: str) -> dict[int, float]:
    """step -> value of one metric; a step recorded twice is an error (it means a bad merge)."""
    out: dict[int, float] = {}
    for r in records:
        if r.step in out:
            raise ValueError(f"run {r.run!r} records step {r.step} twice")
        value = getattr(r, metric)
        out[r.step] = math.nan if value is None else float(value)
    return out


def _check_run_name(name: str) -> None:
    # run names become file names; keep them to something every filesystem and URL accepts
    if not name or not all(c.isalnum() or c in "-_." for c in name) or name.startswith("."):
        raise ValueError(f"run name {name!r} must be [A-Za-z0-9._-]+ and not start with '.'")


def _as_float(name: str, value: Any) -> float:
    value = _decode(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        # tensors land here too: callers convert with .item() so no torch object is stored
        raise ValueError(f"{name} must be a real number, got {value!r}")
    return float(value)


def _nan_is_largest(x: float) -> float:
    return math.inf if math.isnan(x) else x


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float (nested in dicts/lists) replaced by 'nan'/'inf'/'-inf',
    so json.dumps(..., allow_nan=False) accepts it. Used for every file this harness writes."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, Mapping):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, str) and value in _NONFINITE:
        return _NONFINITE[value]
    if isinstance(value, dict):
        return {k: _decode(v) for k, v in value.items()}
    return value


def _atomic_write(path: Path, text: str) -> None:
    # a reader (the report, CI) never sees a half-written file
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
