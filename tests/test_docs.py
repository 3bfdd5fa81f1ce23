"""The front door holds what it says: every shell command in the README and docs/ resolves, every link
between them lands, the pages stay short, and no measured figure appears without its source in RESULTS.md.

Commands are found, not listed: every line of every ```bash block of README.md, docs/*.md and
benchmarks/README.md (continuations joined, comments and ``VAR=value`` prefixes dropped) must be one this
test knows how to resolve. This project's Python commands (``python -m MODULE``, ``python benchmarks/X.py``,
and the same started by ``deepspeed``, ``torchrun``, ``srun``, ``mpirun``, ``sbatch slurm/X.sbatch`` or
``bash scripts/X.sh``) are resolved by running the command's own ``main`` up to its ``parse_args``: the
module exists and its parser accepts every option and value shown. A training command is then resolved as
``--check-config`` resolves it, at the world size the command names, on the tests' real shards. Anything
else (a third-party tool, a placeholder) fails here: show it as inline code or in a ```text block.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

from convbert_ds.engine.plan import resolve
from convbert_ds.formats.train_config import load_config
from launch import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "README.md"]
LINE_LIMITS = {"README.md": 250, "docs/*.md": 250, "benchmarks/RESULTS.md": 400, "benchmarks/runs/*.md": 150}
SLURM_TASKS_PER_NODE = 8  # slurm/pretrain*.sbatch's #SBATCH --ntasks-per-node
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _relative(path: Path) -> str:
    return str(path.relative_to(REPO))


# --- sizes ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pattern, limit", LINE_LIMITS.items())
def test_pages_stay_short(pattern, limit):
    pages = sorted(REPO.glob(pattern))
    assert pages or "*" in pattern, f"{pattern} is missing"
    too_long = {_relative(p): n for p in pages if (n := len(p.read_text().splitlines())) > limit}
    assert not too_long, f"over {limit} lines: {too_long}"


def test_there_are_docs_pages():
    assert len(PAGES) >= 8, [p.name for p in PAGES]


# --- links ------------------------------------------------------------------------------------------------

def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.MULTILINE):
        slug = _slug(heading)
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found | set(re.findall(r"""<a (?:id|name)=["']([^"']+)["']""", text))


def _links(page: Path) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", FENCE.sub("", page.read_text()))
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=_relative)
def test_every_link_lands(page):
    dead = []
    for link in _links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            dead.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            dead.append(f"{link}: no heading or <a id> '{anchor}' in {_relative(target)}")
    assert not dead, f"{_relative(page)}: " + "; ".join(dead)


def test_the_readme_links_every_docs_page():
    linked = {(REPO / link.partition("#")[0]).resolve() for link in _links(REPO / "README.md")}
    missing = [p.name for p in (REPO / "docs").glob("*.md") if p.resolve() not in linked]
    assert not missing, f"README.md does not link {missing}"


# --- figures ----------------------------------------------------------------------------------------------

# A measured figure: a number with the unit of a measurement (speed, share of peak, time, margin, ratio).
FIGURE = re.compile(r"\d[\d,.]*\s*(?:samples/s|tok(?:en)?s/s|TFLOP/s|% MFU|MFU|ms\b|points\b|minutes\b|"
                    r"x (?:the|faster|slower|transformers)|passed\b)")


def _prose_units(page: Path) -> list[str]:
    """Each paragraph, list item and table row outside code blocks: the unit a figure and its source share."""
    units = []
    for block in re.split(r"\n\s*\n", FENCE.sub("", page.read_text())):
        lines = block.splitlines()
        if lines and all(line.startswith("|") for line in lines):
            units += lines
        else:
            units += re.split(r"\n(?=\s*[-*] |\s*\d+\. )", block)
    return units


@pytest.mark.parametrize("page", [p for p in PAGES if p.parent.name != "benchmarks"], ids=_relative)
def test_every_figure_names_its_source_in_results(page):
    unsourced = [u.strip()[:100] for u in _prose_units(page) if FIGURE.search(u) and "RESULTS.md" not in u]
    assert not unsourced, f"{_relative(page)}: figures without a link to benchmarks/RESULTS.md: {unsourced}"


# --- commands ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Command:
    page: str
    line: str

    @property
    def words(self) -> list[str]:
        words = shlex.split(self.line)
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # VAR=value prefixes
            words.pop(0)
        return words


def _commands() -> list[Command]:
    found = []
    for page in PAGES:
        for language, body in FENCE.findall(page.read_text()):
            if language not in ("bash", "sh", "shell"):
                continue
            for line in body.replace("\\\n", " ").splitlines():
                line = re.split(r"(?:^|\s)#", line, maxsplit=1)[0].strip()
                found += [Command(_relative(page), part.strip()) for part in line.split(" && ") if part.strip()]
    return found


COMMANDS = _commands()


class _Parsed(BaseException):
    """Stops a ``main`` right after its ``parse_args`` (BaseException: no handler of the command catches it)."""


@dataclass
class Resolution:
    module: str
    argv: list[str]
    world: int = 1
    training: bool = False


def _option(words: list[str], *names: str, default: int = 0) -> int:
    for i, word in enumerate(words):
        for name in names:
            if word == name and i + 1 < len(words):
                return int(words[i + 1])
            if word.startswith(name + "="):
                return int(word.split("=", 1)[1])
    return default


def _module_of_script(path: str) -> str:
    assert (REPO / path).is_file(), f"{path}: no such script"
    return path.removesuffix(".py").replace("/", ".")


def _python(words: list[str], world: int) -> Resolution:
    """``python -m MODULE ARGS`` or ``python SCRIPT.py ARGS``."""
    if words[1] == "-m":
        module, argv = words[2], words[3:]
    else:
        module, argv = _module_of_script(words[1]), words[2:]
    return Resolution(module, argv, world, training=module == "convbert_ds.train")


def _sbatch(words: list[str]) -> Resolution | None:
    at = next((i for i, w in enumerate(words) if w.endswith(".sbatch")), None)
    assert at is not None, "sbatch without a slurm/*.sbatch script"
    script, args = words[at], words[at + 1:]
    assert (REPO / script).is_file(), f"{script}: no such job script"
    world = _option(words[:at], "--nodes", "-N", default=1) * _option(
        words[:at], "--ntasks-per-node", default=SLURM_TASKS_PER_NODE)
    name = Path(script).stem
    if name.startswith("pretrain"):
        return Resolution("convbert_ds.train", ["--config", *args], world, training=True)
    if name == "convert":
        return Resolution("convbert_ds.convert", args)
    if name == "preprocess":
        return Resolution("preprocessing.shard", args)
    assert name == "preprocess_merge" and len(args) == 1, f"{script}: takes the shard directory alone"
    return None


def _bash(words: list[str]) -> Resolution | None:
    script, args = words[1], words[2:]
    assert (REPO / script).is_file(), f"{script}: no such script"
    if script == "scripts/quickstart.sh":
        return Resolution("convbert_ds.quickstart", args)
    if script == "slurm/preprocess_submit.sh":  # N [sbatch options] -- shard's arguments
        assert "--" in args and int(args[0]) > 0, "preprocess_submit.sh takes N [sbatch options] -- ARGS"
        return Resolution("preprocessing.shard", args[args.index("--") + 1:])
    if script == "scripts/test.sh":  # pytest's arguments: the paths it names must exist
        missing = [a for a in args if a.startswith("tests/") and not (REPO / a.split("::")[0]).exists()]
        assert not missing, f"scripts/test.sh: no such test path {missing}"
    return None


def _resolution(words: list[str]) -> Resolution | None:
    """What the command runs, or None where running the script is all there is to resolve."""
    first = words[0]
    if first in ("python", "python3"):
        return _python(words, 1)
    if first in ("mpirun", "mpiexec", "srun"):
        at = next(i for i, w in enumerate(words) if w in ("python", "python3"))
        return _python(words[at:], _option(words, "-np", "-n", "--ntasks", default=1))
    if first == "deepspeed":
        at = words.index("--module")
        return Resolution(words[at + 1], words[at + 2:], _option(words, "--num_gpus", default=1),
                          training=words[at + 1] == "convbert_ds.train")
    if first == "torchrun":
        at = words.index("-m")
        return Resolution(words[at + 1], words[at + 2:], _option(words, "--nproc_per_node", default=1),
                          training=words[at + 1] == "convbert_ds.train")
    if first == "sbatch":
        return _sbatch(words)
    if first == "bash":
        return _bash(words)
    if first == "export":
        assert all(re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", w) for w in words[1:]), "export takes VAR=value"
        return None
    raise AssertionError(f"'{first}' is not a command of this project: show it as inline code or in a "
                         f"```text block, or teach tests/test_docs.py to resolve it")


def _parse(module: str, argv: list[str]) -> argparse.Namespace | None:
    """Run ``module``'s main up to its parse_args; the parsed arguments (None for --help)."""
    original = argparse.ArgumentParser.parse_args

    def parse_and_stop(parser, args=None, namespace=None):
        raise _Parsed(original(parser, args, namespace))

    try:
        mod = importlib.import_module(f"{module}.__main__")
    except ModuleNotFoundError as error:
        if error.name != f"{module}.__main__":
            raise
        mod = importlib.import_module(module)
    err = io.StringIO()
    with mock.patch.dict(os.environ), mock.patch.object(argparse.ArgumentParser, "parse_args", parse_and_stop), \
            contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            mod.main(argv)
        except _Parsed as parsed:
            return parsed.args[0]
        except SystemExit as stop:  # --help
            assert stop.code in (0, None), f"{module} {shlex.join(argv)}: exit {stop.code}: {err.getvalue()}"
            return None
    raise AssertionError(f"{module} {shlex.join(argv)}: refused: {err.getvalue().strip()}")


def test_the_docs_have_commands_to_check():
    assert len(COMMANDS) >= 40, len(COMMANDS)
    assert sum(_resolution(c.words) is not None and _resolution(c.words).training for c in COMMANDS) >= 6


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.page}: {c.line[:70]}" for c in COMMANDS])
def test_every_command_resolves(command, tiny_corpus, tmp_path):
    resolution = _resolution(command.words)
    if resolution is None:
        return
    args = _parse(resolution.module, resolution.argv)
    if not resolution.training or args is None or args.config is None:
        return
    # The tests' corpus stands in for the user's shards; a phase 2's phase 1 exists only after that run.
    overrides = [o for o in args.overrides if not o.startswith(("data.sets=", "checkpoint.dir="))]
    cfg = load_config(REPO / args.config, overrides + [
        f"data.sets=[{{path: '{tiny_corpus['shards']}', weight: 1.0}}]",
        f"checkpoint.dir={tmp_path / 'checkpoints'}", "phase.continue_from=null"])
    world = args.world_size or resolution.world
    plan = resolve(cfg, world, cuda=True)
    assert plan.micro_batch_size * plan.grad_accum * (world // cfg.pipeline.stages) == cfg.train.global_batch_size
