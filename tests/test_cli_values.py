"""Every numeric or choice option of every command line users run, fed values it must refuse.

Each command's parser is read from its own ``main`` (stopped at ``parse_args``), so an option added later
is covered without listing it here. Two properties:

- every option that takes a number declares its range at the parser (``convbert_ds.cli.bounded``) or
  its choices; a bare ``type=int`` / ``type=float`` fails here;
- every value outside that range (below it, above it, on an open end, not finite, not a number, empty,
  not whole for an integer, not one of the choices) ends in one line on stderr that names the option,
  with exit code 2, through the command's real entry point. Hypothesis adds random text and numbers.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from unittest import mock

import pytest
from hypothesis import assume, given, seed
from hypothesis import strategies as st

from convbert_ds.cli import exit_on_user_error
from launch import REPO
from test_cli_fuzz import CLIS, FUZZ, REQUIRED, _stderr_lines, call

# Every benchmark script (a file under benchmarks/ that runs as a program: the user benchmarks, the GPU
# acceptance, the analysis tools), found, so one added later is covered too; the arguments those that need
# any require (never opened: the parser refuses the bad value first).
BENCHMARKS = sorted(".".join(path.relative_to(REPO).with_suffix("").parts)
                    for path in (REPO / "benchmarks").rglob("*.py") if 'if __name__ == "__main__":' in path.read_text())
BENCHMARK_ARGS = {"benchmarks.hf_finetune_check": ["--model", "m", "--task-dir", "t"],
                  "benchmarks.analysis.trace_summary": ["t.json"]}
# The commands beyond the CLIs of test_cli_fuzz: the data builders and the benchmarks.
MORE = {"convbert_ds.builtin.stdlib_docstrings": ["--out", "o"], "convbert_ds.builtin.docstring_summaries": [],
        **{module: BENCHMARK_ARGS.get(module, []) for module in BENCHMARKS}}
COMMANDS = sorted([*CLIS, *MORE])


class _Parsed(BaseException):
    """Stops a ``main`` at its ``parse_args``, carrying the parser (BaseException: no handler catches it)."""


def run(module: str, argv: list[str]) -> int:
    if module in CLIS:
        return call(module, argv)
    mod = importlib.import_module(module)
    return exit_on_user_error(lambda: mod.main(argv))


def parser_of(module: str) -> argparse.ArgumentParser:
    def stop(parser, *args, **kwargs):
        raise _Parsed(parser)

    # The environment as it was afterwards: main stopped this way skips its own clean-up (the train CLI's
    # discovery sets RANK/WORLD_SIZE, which later launches from this process would inherit).
    with mock.patch.dict(os.environ), mock.patch.object(argparse.ArgumentParser, "parse_args", stop):
        try:
            run(module, list(REQUIRED.get(module, MORE.get(module, []))))
        except _Parsed as parsed:
            return parsed.args[0]
    raise AssertionError(f"{module}: main() returned without parsing its arguments")


def _options(module: str) -> list[tuple[list[str], argparse.Action]]:
    """(the arguments that come first, the option) for each option a user can pass a value to: not flags,
    not hidden internals, not positionals; a subcommand's own options too."""
    return _valued(parser_of(module), list(REQUIRED.get(module, MORE.get(module, []))))


def _valued(parser: argparse.ArgumentParser, first: list[str]) -> list[tuple[list[str], argparse.Action]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                needs = [arg for a in sub._actions if a.required and a.option_strings for arg in (a.option_strings[0], "x")]
                found += _valued(sub, [*first, name, *needs])
        elif action.option_strings and action.nargs != 0 and action.help != argparse.SUPPRESS:
            found.append((first, action))
    return found


OPTIONS = {module: _options(module) for module in COMMANDS}  # read once, at collection


def bad_values(action: argparse.Action) -> list[str]:
    """Values outside what ``action`` declares; [] for free text (names, paths: test_cli_fuzz's)."""
    if action.choices is not None:
        return ["zz-not-a-choice", ""]
    bounds = getattr(action.type, "bounds", None)
    if bounds is None:
        return []
    step = 1 if bounds["kind"] is int else 0.5
    values = ["", "ten", "nan", "inf", "-inf", "1e999"] + (["1.5", "2e0"] if bounds["kind"] is int else [])
    for name, outside in (("min", -step), ("max", step), ("above", 0), ("below", 0)):
        if bounds[name] is not None:
            values.append(repr(bounds[name] + outside) if bounds["kind"] is float else str(int(bounds[name] + outside)))
    return values


def _refused_in_one_line(module: str, first: list[str], action: argparse.Action, value: str, capsys) -> str | None:
    """None if ``FIRST --option=value`` ends in one line naming the option, exit 2; else what happened."""
    option = action.option_strings[-1]
    code = run(module, [*first, f"{option}={value}"])
    err = _stderr_lines(capsys)
    if code == 2 and len(err) == 1 and option in err[0]:
        return None
    return f"{module} {option}={value!r}: exit {code}, stderr {err}"


def test_every_benchmark_script_is_found():
    """The user benchmarks at benchmarks/ (``common`` is shared code), the GPU acceptance and the analysis tools
    that take a command line."""
    top = [module for module in BENCHMARKS if module.count(".") == 1]
    assert len(top) == 15 and "benchmarks.common" not in top, top
    assert {"benchmarks.gpu.acceptance", "benchmarks.analysis.trace_summary", "benchmarks.analysis.step_ops", "benchmarks.analysis.flop_count"} <= set(BENCHMARKS), BENCHMARKS


def test_every_number_option_declares_its_range():
    bare = [f"{module} {action.option_strings[-1]} (type={action.type.__name__})"
            for module, actions in OPTIONS.items() for _, action in actions
            if action.type in (int, float) and action.choices is None]
    assert not bare, "declare the range with convbert_ds.cli.bounded, or choices: " + ", ".join(bare)


def test_every_value_out_of_range_is_one_line_naming_the_option(capsys):
    cases = [(module, first, action, value) for module, actions in OPTIONS.items() for first, action in actions
             for value in bad_values(action)]
    reach = len({(module, tuple(first), action.dest) for module, first, action, _ in cases})
    assert reach > 70, reach  # the suite's reach: every option that declares a range or choices
    failures = [failed for module, first, action, value in cases
                if (failed := _refused_in_one_line(module, first, action, value, capsys))]
    assert not failures, "\n".join(failures)


NUMBER_OPTIONS = [(module, first, action) for module, actions in OPTIONS.items() for first, action in actions
                  if getattr(action.type, "bounds", None)]


@seed(20261125)
@FUZZ
@given(case=st.sampled_from(NUMBER_OPTIONS),
       value=st.one_of(st.text(max_size=12), st.integers(-10**30, 10**30).map(str),
                       st.floats(allow_nan=True, allow_infinity=True).map(repr)))
def test_random_values_the_range_refuses_are_one_line(case, value, capsys):
    module, first, action = case
    try:
        action.type(value)
        assume(False)  # a valid value would start the command: only refused ones are fed
    except argparse.ArgumentTypeError:
        pass
    failed = _refused_in_one_line(module, first, action, value, capsys)
    assert failed is None, failed


@pytest.mark.parametrize("script", ["benchmarks/train_step.py", "benchmarks/sdconv.py"])
def test_a_benchmark_started_as_a_script_says_it_in_one_line(script):
    """``python benchmarks/X.py --batch=0``, as the README shows them run: one line, exit 2, no traceback."""
    done = subprocess.run([sys.executable, script, "--batch=0"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    err = [line for line in done.stderr.splitlines() if line.strip() and "[WARNING]" not in line]
    assert done.returncode == 2 and len(err) == 1 and "--batch" in err[0], done.stderr
