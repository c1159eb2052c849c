"""One declaration per config field (issue 22): the flags, their help, defaults and valid values,
the repro line and the strategies are generated from the dataclasses, so adding a knob is one
edit; converge shares the check's fields; a case names the knob class it reads. Pure: no ranks."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import typing
from dataclasses import dataclass

import pytest
from hypothesis import given, settings

from sp_harness.cli import build_parser, config_from_args
from sp_harness.config.case import Case
from sp_harness.config.check_config import ENGINE_DEFAULTS, KNOBS, CheckConfig, RunFields
from sp_harness.config.converge_options import ConvergeOptions, repro_line
from sp_harness.config.flags import add_flags, check_values, docstrings, from_args, knob, repro_args, specs
from sp_harness.config.gpt_knobs import GPTKnobs
from sp_harness.config.registry import get_case
from sp_harness.config.strategies import knob_values


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _dests(parser: argparse.ArgumentParser) -> set[str]:
    return {a.dest for a in parser._actions}


def test_the_record_keeps_every_field_flat():
    # meta.json's and the verdict's "config": the 26 keys from before the knobs moved out, and
    # the training-step check's three
    assert {f.name for f in dataclasses.fields(CheckConfig)} == {
        "case", "world_size", "dp", "seq_len", "seq_shards", "batch", "hidden", "ffn", "num_heads", "num_kv_heads",
        "causal", "load_balancer", "ring_degree", "prompt_len", "num_layers", "vocab", "norm", "layout", "dtype",
        "steps", "seed", "lr", "optimizer", "adversary", "timeout_s", "forward_only",
        "train_step", "micro_batches", "clip_grad_norm"}


@pytest.mark.parametrize("cls", [CheckConfig, ConvergeOptions, GPTKnobs])
def test_every_field_is_documented(cls):
    missing = [f.name for f in dataclasses.fields(cls) if not docstrings(cls).get(f.name)]
    assert not missing, missing


@pytest.mark.parametrize(("command", "cls"), [("check", CheckConfig), ("converge", ConvergeOptions),
                                              ("golden", ConvergeOptions)])
def test_every_field_is_a_flag(command, cls):
    assert {f.name for f in dataclasses.fields(cls)} <= _dests(_subparser(command))


def test_converge_shares_the_checks_declarations():
    for f in dataclasses.fields(RunFields):
        check, converge = ({s.name: s for s in specs(c)}[f.name] for c in (CheckConfig, ConvergeOptions))
        assert (check.option, check.flag, check.kind, check.choices) == (
            converge.option, converge.flag, converge.kind, converge.choices), f.name
    assert _dests(_subparser("nightly")) >= {"case", "world_size", "steps"}


def test_help_names_the_engine_default_a_none_becomes():
    helps = {a.dest: a.help for a in _subparser("check")._actions}
    for name, value in ENGINE_DEFAULTS.items():
        shown = ("yes" if value else "no") if isinstance(value, bool) else str(value)
        assert f"else {shown})" in helps[name], (name, helps[name])
    assert "(default 2)" in helps["world_size"] and "(default off)" in helps["adversary"]
    converge = {a.dest: a.help for a in _subparser("converge")._actions}
    assert "(default 200)" in converge["steps"] and "0 means off" in converge["clip_grad_norm"]


@pytest.mark.parametrize(("argv", "needles"), [
    (["--world-size", "0"], ["--world-size", ">= 1"]),
    (["--seq-shards", "4,x"], ["--seq-shards", "4,4,2"]),
    (["--seq-shards", "4,-1"], ["--seq-shards", ">= 0"]),
    (["--causal", "maybe"], ["--causal", "yes or no"]),
    (["--dtype", "float16"], ["--dtype", "float64"]),
    (["--hidden", "2.5"], ["--hidden", "whole number"]),
])
def test_a_bad_flag_value_exits_2_naming_the_flag_and_what_is_valid(argv, needles, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["check", "--case", "seed-mlp", *argv])
    assert exc.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert all(n in error for n in needles), error


def test_the_value_checks_are_the_declared_ones():
    for bad, match in ((dict(hidden=0), "hidden must be >= 1"), (dict(prompt_len=-1), "prompt_len must be >= 0"),
                       (dict(norm="batchnorm"), "norm must be one of"), (dict(lr=0.0), "lr must be a finite")):
        with pytest.raises(ValueError, match=match):
            CheckConfig(case="x", **bad)
    with pytest.raises(ValueError, match=r"dtype must be one of"):
        ConvergeOptions(dtype="float16")
    with pytest.raises(ValueError, match=r"dp\(2\) does not divide world_size\(3\)"):
        ConvergeOptions(world_size=3, dp=2)


def test_the_check_repro_parses_back_to_the_same_config():
    cfg = CheckConfig(case="megatron-gpt-sp", world_size=3, seq_shards=(4, 0, 2), causal=False, forward_only=True,
                      load_balancer="zigzag", timeout_s=7.25, lr=1 / 3, adversary="reorder")
    back = config_from_args(build_parser().parse_args(shlex.split(cfg.repro())[1:]))
    case = get_case(cfg.case)
    assert case.resolve(back) == case.resolve(cfg)


@pytest.mark.parametrize("command", ["converge", "golden"])
def test_the_converge_repro_parses_back_bit_for_bit(command):
    opts = ConvergeOptions(case="seed-mlp", baseline="", steps=5, lr=0.1 / 3, clip_grad_norm=None, dtype="float64",
                           seq_len=10, timeout_s=33.5, data_seed=7, warmup_steps=0)
    extra = dict(out="g.json") if command == "golden" else {}
    argv = shlex.split(repro_line(command, opts, **extra))[1:]
    assert "--clip-grad-norm" in argv and argv[argv.index("--clip-grad-norm") + 1] == "0"
    args = build_parser().parse_args(argv)
    assert from_args(ConvergeOptions, args, baseline=args.baseline or "") == opts
    assert repro_line("converge", ConvergeOptions()) == "sp-harness converge"


def test_a_new_knob_is_one_declaration():
    @dataclass(kw_only=True, frozen=True)
    class Tuned(RunFields):
        dropout: float | None = knob(name="--drop", none="off", min=0.0)
        """Dropout probability. None: no dropout."""
        rope: typing.Literal["none", "llama"] = "none"
        """Rotary embedding flavour."""

    parser = argparse.ArgumentParser()
    add_flags(parser, Tuned)
    helps = {a.dest: a.help for a in parser._actions}
    assert helps["dropout"] == "Dropout probability (default: no dropout)"
    assert helps["rope"] == "Rotary embedding flavour (default none)"
    tuned = from_args(Tuned, parser.parse_args(["--case", "c", "--drop", "0.25", "--rope", "llama"]))
    assert (tuned.dropout, tuned.rope) == (0.25, "llama")
    assert from_args(Tuned, parser.parse_args(["--case", "c", "--drop", "off"])).dropout is None
    assert repro_args(tuned, Tuned(case="c")) == ["--drop", "0.25", "--rope", "llama"]
    with pytest.raises(ValueError, match="dropout must be >= 0"):
        check_values(Tuned(case="c", dropout=-1.0))


def test_a_case_defaults_only_its_own_knobs():
    base = get_case("seed-mlp")
    fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
    assert base.knobs is GPTKnobs and GPTKnobs in KNOBS
    with pytest.raises(ValueError, match=r"unknown config fields \['hidden'\]"):
        Case(**{**fields, "name": "no-knobs", "knobs": None})
    with pytest.raises(ValueError, match="not a knob class CheckConfig carries"):
        Case(**{**fields, "name": "alien", "knobs": ConvergeOptions})
    cfg = base.resolve(CheckConfig(case="seed-mlp", hidden=12))
    assert cfg.knob_values(GPTKnobs).hidden == 12


@settings(max_examples=25, deadline=None)
@given(knob_values(GPTKnobs))
def test_the_strategies_draw_valid_knobs_from_the_declarations(knobs):
    config = CheckConfig(case="megatron-gpt-sp", **dataclasses.asdict(knobs))
    assert config.knob_values(GPTKnobs) == knobs


def test_converge_hands_its_shared_fields_to_the_check_config():
    opts = ConvergeOptions(case="seed-mlp", world_size=4, dp=2, steps=7, lr=0.5, seed=3)
    config = CheckConfig(**opts.run_values())
    assert {f.name: getattr(config, f.name) for f in dataclasses.fields(RunFields)} == opts.run_values()
