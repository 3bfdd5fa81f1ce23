"""The architecture contract: layers that import only downwards (import-linter, configured in pyproject.toml),
no import cycle, no hidden project import inside a function, no file over 500 lines; the job scripts' copies of
the trainer's exit codes equal to it."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import grimp

from convbert_ds.engine import checkpoint, distributed, step_guard
from launch import REPO, env

PACKAGES = ("convbert_ds", "preprocessing")
MAX_LINES = 500


def _python_files(*roots: str):
    for root in roots:
        yield from sorted((REPO / root).rglob("*.py"))


def test_layers_contract_holds():
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint)], cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


def test_no_import_cycle_among_the_projects_modules():
    """Imports inside functions count: hiding a cycle in a function does not remove it."""
    graph = grimp.build_graph(*PACKAGES)
    edges = {module: graph.find_modules_directly_imported_by(module) for module in graph.modules}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(module):] + [module]))
        if module in done:
            return
        for imported in sorted(edges.get(module, ())):
            visit(imported, path + [module])
        done.add(module)

    for module in sorted(edges):
        visit(module, [])


def test_project_imports_inside_functions_say_why():
    hidden = []
    for path in _python_files(*PACKAGES):
        lines = path.read_text().splitlines()
        for function in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                module = getattr(node, "module", None) or (node.names[0].name if isinstance(node, ast.Import) else "")
                if isinstance(node, (ast.Import, ast.ImportFrom)) and module.split(".")[0] in PACKAGES:
                    nearby = lines[node.lineno - 2: node.lineno]
                    if not any("#" in line for line in nearby):
                        hidden.append(f"{path.relative_to(REPO)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not hidden, "project imports inside functions without a comment saying why:\n" + "\n".join(hidden)


def test_no_file_over_500_lines():
    long = [f"{path.relative_to(REPO)}: {n}" for path in _python_files(*PACKAGES, "tests", "benchmarks")
            if (n := len(path.read_text().splitlines())) > MAX_LINES]
    assert not long, f"files over {MAX_LINES} lines (split them by responsibility): {long}"


def test_the_job_scripts_exit_codes_are_the_trainers():
    """``slurm/common.sh`` acts on the trainer's exit codes (requeue, not requeue, look for a lost node); a shell
    script cannot import them, so its copies are held equal here."""
    shell = dict(re.findall(r"^(EXIT_\w+)=(\d+)", (REPO / "slurm" / "common.sh").read_text(), re.M))
    assert shell == {"EXIT_PREEMPTED": str(step_guard.EXIT_PREEMPTED), "EXIT_NOT_SAVED": str(checkpoint.EXIT_NOT_SAVED),
                     "EXIT_PEER_LOST": str(distributed.EXIT_PEER_LOST)}
