"""The front door holds what it says: every shell command in the README and docs/ resolves, every link
between them lands, the pages stay short, and no measured figure appears without its source in RESULTS.md.

Commands are found, not listed: every line of every ```bash block of README.md, docs/*.md and
benchmarks/README.md (continuations joined, comments and ``VAR=value`` prefixes dropped) must be one this
test knows how to resolve. This project's Python commands (``python -m MODULE``, ``python benchmarks/X.py``,
and the same started by ``deepspeed``, ``torchrun``, ``srun``, ``mpirun``, ``sbatch slurm/X.sbatch`` or
``bash scripts/X.sh``) are resolved through the command's own argument parsing (its ``parse_args`` where it
has one, with the checks it makes across options; else its ``main`` stopped at ``ArgumentParser.parse_args``):
the module exists and accepts every option and value shown. A training command is then resolved as
``--check-config`` resolves it, at the world size the command names, on the tests' real shards. Anything
else (a third-party tool) fails here: show it as inline code or in a ```text block. A command of this project
quoted in inline code or a ```text block is resolved the same way when it is concrete, and must at least name
a module or script that exists when it is a synopsis (``CONFIG.yaml``, ``[--tag TAG]``, ``...``). Fences must
say their language, and Python blocks must compile with imports that resolve.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import io
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

from convbert_ds.engine.plan import resolve
from convbert_ds.errors import UserError
from convbert_ds.formats.train_config import load_config
from launch import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "README.md"]
RECORDS = [REPO / "benchmarks" / "RESULTS.md", *sorted((REPO / "benchmarks" / "runs").glob("*.md"))]
LINE_LIMITS = {"README.md": 250, "docs/*.md": 250, "benchmarks/RESULTS.md": 400, "benchmarks/runs/*.md": 150}
LANGUAGES = ("bash", "text", "python", "yaml", "json")
FENCE_LINE = re.compile(r"^(\s*)(```|~~~)\s*([^\s`]*)")
ASSIGNMENT = re.compile(r"[A-Z_][A-Z0-9_]*=.*", re.DOTALL)  # a shell word VAR=value (shlex has unquoted it)


def _relative(path: Path) -> str:
    return str(path.relative_to(REPO))


@dataclass(frozen=True)
class Page:
    """A Markdown page split as CommonMark splits it: fenced blocks (language, body) and the prose around them."""
    blocks: list[tuple[str, str]]
    prose: str


def _split(path: Path) -> Page:
    blocks, prose, fence, indent, language, body = [], [], None, "", "", []
    for line in path.read_text().splitlines():
        opened = FENCE_LINE.match(line)
        if fence is None and opened:
            indent, fence, language, body = opened.group(1), opened.group(2), opened.group(3), []
        elif fence is not None and line.strip().startswith(fence) and not line.strip().strip(fence[0]):
            blocks.append((language, "\n".join(body) + "\n"))
            fence = None
        elif fence is not None:
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
        else:
            prose.append(line)
    assert fence is None, f"{_relative(path)}: a code fence is never closed"
    return Page(blocks, "\n".join(prose))


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
    text = _split(page).prose
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.MULTILINE):
        slug = _slug(heading)
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found | set(re.findall(r"""<a (?:id|name)=["']([^"']+)["']""", text))


def _links(page: Path) -> list[str]:
    """Inline links (a title after the target allowed), reference definitions and ``<a href>``; not URLs."""
    text = re.sub(r"`[^`\n]*`", "", _split(page).prose)
    targets = re.findall(r"\]\(<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\)", text)
    targets += re.findall(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", text, re.MULTILINE)
    targets += re.findall(r"""<a [^>]*href=["']([^"']+)["']""", text)
    return [t for t in targets if not re.match(r"[a-z][a-z+.-]*:", t)]


@pytest.mark.parametrize("page", PAGES + RECORDS, ids=_relative)
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
FIGURE = re.compile(r"\d[\d,.]*\s*(?:samples/s|tok(?:en)?s/s|TFLOP/s|[TGM]B/s|% MFU|MFU|ms\b|points\b|minutes\b|"
                    r"seconds\b|s a step|% (?:faster|slower)|x (?:eager|faster|slower|the|its|"
                    r"transformers|as fast)|passed\b)")


def _prose_units(page: Path) -> list[str]:
    """Each paragraph, list item and table row outside code blocks: the unit a figure and its source share."""
    units = []
    for block in re.split(r"\n\s*\n", _split(page).prose):
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
    strict: bool = True  # a ```bash line; False: quoted in prose or a ```text block (a synopsis may stand there)

    @property
    def words(self) -> list[str]:
        words = shlex.split(self.line)
        while words and ASSIGNMENT.fullmatch(words[0]):  # VAR=value prefixes
            words.pop(0)
        return words

    @property
    def synopsis(self) -> bool:
        """Placeholders (``CONFIG.yaml``, ``N``, ``[--tag TAG]``, ``...``): a command's form, not one to run
        as it stands."""
        return bool(re.search(r"\.\.\.|\[|<[A-Za-z]|(?:^|[\s=/:])[A-Z][A-Z_]*(?=[\s./]|$)", self.line))


# A command of this project quoted outside a ```bash block: in inline code, or a line of a ```text block.
PROJECT_COMMAND = re.compile(r"^(?:[A-Z_]+=\S+ )*(?:python3? (?:-m (?:convbert_ds|preprocessing|benchmarks)\b|"
                             r"benchmarks/)|bash (?:scripts|slurm|benchmarks)/|sbatch .*slurm/|"
                             r"(?:deepspeed|torchrun|mpirun|srun) .*convbert_ds)")


def _commands() -> list[Command]:
    found = []
    for path in PAGES:
        page, where = _split(path), _relative(path)
        for language, body in page.blocks:
            lines = body.replace("\\\n", " ").splitlines()
            if language == "bash":
                for line in lines:
                    line = re.split(r"(?:^|\s)#", line, maxsplit=1)[0].strip()
                    found += [Command(where, part.strip()) for part in line.split(" && ") if part.strip()]
            elif language == "text":
                found += [Command(where, line.strip().lstrip("$ "), strict=False) for line in lines
                          if PROJECT_COMMAND.match(line.strip().lstrip("$ "))]
        found += [Command(where, span.strip(), strict=False) for span in re.findall(r"`([^`\n]+)`", page.prose)
                  if PROJECT_COMMAND.match(span.strip())]
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
    """A numeric option's value (``--name N`` or ``--name=N``); the default where it is absent or a placeholder."""
    for i, word in enumerate(words):
        for name in names:
            value = words[i + 1] if word == name and i + 1 < len(words) else \
                word.split("=", 1)[1] if word.startswith(name + "=") else None
            if value is not None:
                return int(value) if value.isdigit() else default
    return default


def _module_of_script(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def _python(words: list[str], world: int) -> Resolution:
    """``python -m MODULE ARGS`` or ``python SCRIPT.py ARGS``."""
    if words[1] == "-m":
        module, argv = words[2], words[3:]
    else:
        module, argv = _module_of_script(words[1]), words[2:]
    return Resolution(module, argv, world, training=module == "convbert_ds.train")


def _header_option(script: str, name: str) -> int:
    """A job script's own ``#SBATCH --name=N``."""
    found = re.search(rf"^#SBATCH {name}=(\d+)", (REPO / script).read_text(), re.MULTILINE)
    assert found, f"{script} has no #SBATCH {name}"
    return int(found.group(1))


def _sbatch(words: list[str]) -> Resolution | None:
    at = next((i for i, w in enumerate(words) if w.endswith(".sbatch")), None)
    assert at is not None, "sbatch without a slurm/*.sbatch script"
    script, args = words[at], words[at + 1:]
    assert (REPO / script).is_file(), f"{script}: no such job script"
    name = Path(script).stem
    if name.startswith("pretrain"):
        # pretrain.sbatch starts one task per process; pretrain_deepspeed.sbatch one launcher per node, which
        # starts a process per GPU.
        per_node = "--gpus-per-node" if name == "pretrain_deepspeed" else "--ntasks-per-node"
        world = _option(words[:at], "--nodes", "-N", default=_header_option(script, "--nodes")) * _option(
            words[:at], per_node, default=_header_option(script, per_node))
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
        assert "--" in args and (not args[0].isdigit() or int(args[0]) > 0), \
            "preprocess_submit.sh takes N [sbatch options] -- ARGS"
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
        assert all(ASSIGNMENT.fullmatch(w) for w in words[1:]), "export takes VAR=value"
        return None
    raise AssertionError(f"'{first}' is not a command of this project: show it as inline code or in a "
                         f"```text block, or teach tests/test_docs.py to resolve it")


def _exists(module: str) -> None:
    """The module a command runs can be found (a package's ``__main__`` included)."""
    assert importlib.util.find_spec(module) is not None, f"no module {module}"


def _entry(module: str):
    """What ``python -m module`` runs: the package's ``__main__``, or the module itself."""
    _exists(module)
    if importlib.util.find_spec(module).submodule_search_locations is not None:
        return importlib.import_module(f"{module}.__main__")
    return importlib.import_module(module)


def _parse(module: str, argv: list[str]) -> argparse.Namespace | None:
    """``module``'s arguments parsed as the command parses them; None for --help. Through its own
    ``parse_args(argv)`` where it has one (with the checks it makes across options), else its ``main`` stopped
    right after ``ArgumentParser.parse_args``."""
    mod, err = _entry(module), io.StringIO()
    original = argparse.ArgumentParser.parse_args

    def parse_and_stop(parser, args=None, namespace=None):
        raise _Parsed(original(parser, args, namespace))

    with mock.patch.dict(os.environ), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            if callable(getattr(mod, "parse_args", None)):
                return mod.parse_args(argv)
            with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_and_stop):
                mod.main(argv)
        except _Parsed as parsed:
            return parsed.args[0]
        except UserError as error:
            if re.search(r"needs? a CUDA GPU", str(error)):  # a GPU's command, as far as a CPU can resolve it
                return None
            raise AssertionError(f"{module} {shlex.join(argv)}: refused: {error}") from None
        except SystemExit as stop:  # --help
            assert stop.code in (0, None), f"{module} {shlex.join(argv)}: exit {stop.code}: {err.getvalue()}"
            return None
    raise AssertionError(f"{module} {shlex.join(argv)}: refused: {err.getvalue().strip()}")


def test_the_docs_have_commands_to_check():
    strict = [_resolution(c.words) for c in COMMANDS if c.strict]
    assert len(strict) >= 60, len(strict)
    assert sum(r is not None and r.training for r in strict) >= 10


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.page}: {c.line[:70]}" for c in COMMANDS])
def test_every_command_resolves(command, tiny_corpus, tmp_path):
    resolution = _resolution(command.words)
    if resolution is None:
        return
    if not command.strict and (command.synopsis or not resolution.argv):  # a command named, or its form
        if not re.search(r"(?:^|\.)[A-Z]", resolution.module):  # not a placeholder itself (benchmarks/NAME.py)
            _exists(resolution.module)
        return
    args = _parse(resolution.module, resolution.argv)
    if not resolution.training or args is None or args.config is None:
        return
    load_config(REPO / args.config, args.overrides)  # the command's own values, its data.sets included
    # The tests' corpus stands in for the user's shards; a phase 2's phase 1 exists only after that run; the
    # user's object store is not there.
    overrides = [o for o in args.overrides if not o.startswith(("data.sets=", "checkpoint.dir=", "checkpoint.mirror="))]
    cfg = load_config(REPO / args.config, overrides + [
        f"data.sets=[{{path: '{tiny_corpus['shards']}', weight: 1.0}}]",
        f"checkpoint.dir={tmp_path / 'checkpoints'}", "phase.continue_from=null"])
    world = args.world_size or resolution.world
    plan = resolve(cfg, world, cuda=True)
    assert plan.micro_batch_size * plan.grad_accum * (world // cfg.pipeline.stages) == cfg.train.global_batch_size


# --- code blocks ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("page", PAGES, ids=_relative)
def test_every_code_block_says_its_language(page):
    unknown = [language or "(none)" for language, _ in _split(page).blocks if language not in LANGUAGES]
    assert not unknown, f"{_relative(page)}: fences must say one of {LANGUAGES}, not {unknown}"


@pytest.mark.parametrize("page", PAGES, ids=_relative)
def test_python_blocks_compile_and_their_imports_resolve(page):
    for language, body in _split(page).blocks:
        if language != "python":
            continue
        for node in ast.walk(ast.parse(body, _relative(page))):
            if isinstance(node, ast.ImportFrom):
                module = importlib.import_module(node.module)
                missing = [a.name for a in node.names if not hasattr(module, a.name)]
                assert not missing, f"{_relative(page)}: {node.module} has no {missing}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    _exists(alias.name)


def test_the_benchmarks_top_level_holds_user_benchmarks_each_named_in_its_readme():
    scripts = [p.name for p in (REPO / "benchmarks").glob("*.py") if p.stem not in ("__init__", "common")]
    assert 0 < len(scripts) <= 15, scripts
    readme = (REPO / "benchmarks" / "README.md").read_text()
    assert not [name for name in scripts if f"`{name}`" not in readme], "benchmarks/README.md does not name them"
