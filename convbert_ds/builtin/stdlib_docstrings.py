"""A small corpus of real English text that every Python installation carries.

The docstrings of the standard library are written by people, in English, and
ship with every CPython, so the quickstart, the tests and the benchmarks can
train on real text without downloading anything or committing third-party text
to this repository. Files are parsed with ``ast`` (nothing is imported, so no
module's import-time side effects run) in sorted order, so the corpus is the
same on every run of the same Python.

Output format is the plain-text corpus format that ``preprocessing`` reads:
one paragraph per line, a blank line between documents (one docstring = one
document).
"""

from __future__ import annotations

import ast
import os
import re
import sys
import sysconfig
from collections import deque
from collections.abc import Iterator
from pathlib import Path

from convbert_ds.cli import ArgumentParser, bounded, exit_on_user_error
from convbert_ds.fsutil import write_text_atomically

# Directories whose docstrings are mostly code, generated tables or test noise.
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
              "lib2to3", "turtledemo", "encodings", "pydoc_data", "ensurepip", "venv"}
_MIN_WORDS_PER_PARAGRAPH = 4
_MIN_WORDS_PER_DOCUMENT = 12
_WORD = re.compile(r"[A-Za-z]{2,}")


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return sorted(files)


_DEFINITIONS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


# The nodes whose bodies hold statements: a definition (and so a docstring) is never inside an expression.
_STATEMENT_HOLDERS = (ast.stmt, ast.excepthandler, ast.match_case)


def _statements(tree: ast.Module) -> Iterator[ast.AST]:
    """``ast.walk``'s nodes in its order, less the expressions (about 7 in 8 nodes of the standard library)."""
    queue = deque([tree])
    while queue:
        node = queue.popleft()
        yield node
        queue.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, _STATEMENT_HOLDERS))


def _docstrings(path: Path, kinds: tuple[type, ...] = (ast.Module, *_DEFINITIONS)) -> Iterator[str]:
    """Docstrings of one file's nodes of ``kinds`` (default: the module's, its classes' and functions')."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    for node in _statements(tree):
        if isinstance(node, kinds):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                yield doc


def _prose_paragraphs(docstring: str) -> list[str]:
    """Keep the prose paragraphs of a docstring; drop doctests, code and tables."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", docstring):
        lines = block.splitlines()
        if any(line.startswith((" ", "\t", ">>>", "...")) for line in lines):
            continue
        text = " ".join(line.strip() for line in lines)
        words = text.split()
        # Mostly-symbol blocks (signatures, tables) have few real words.
        if len(words) < _MIN_WORDS_PER_PARAGRAPH or len(_WORD.findall(text)) < 0.6 * len(words):
            continue
        paragraphs.append(" ".join(words))
    return paragraphs


def iter_documents(max_bytes: int | None = None) -> Iterator[list[str]]:
    """Yield documents (lists of paragraphs), stopping once ``max_bytes`` of text were yielded."""
    produced = 0
    for path in _stdlib_files():
        for docstring in _docstrings(path):
            paragraphs = _prose_paragraphs(docstring)
            if sum(len(p.split()) for p in paragraphs) < _MIN_WORDS_PER_DOCUMENT:
                continue
            yield paragraphs
            produced += sum(len(p) + 1 for p in paragraphs) + 1
            if max_bytes is not None and produced >= max_bytes:
                return


def write_corpus(out: str | os.PathLike, max_bytes: int | None = None, repeat_to_bytes: int | None = None) -> Path:
    """Write the corpus to ``out`` (written to a temporary name, then renamed).

    ``repeat_to_bytes`` repeats the whole corpus until the file reaches that
    size, for benchmarks that need more text than the docstrings hold.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = "".join("\n".join(paragraphs) + "\n\n" for paragraphs in iter_documents(max_bytes))
    if repeat_to_bytes is not None and text:
        text *= max(1, -(-repeat_to_bytes // len(text.encode("utf-8"))))  # whole copies up to the size
    write_text_atomically(out, text)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="text file to write")
    parser.add_argument("--max-bytes", type=bounded(int, min=1), default=None, help="stop after about this many bytes")
    parser.add_argument("--repeat-to-bytes", type=bounded(int, min=1), default=None,
                        help="repeat the corpus until the file has at least this many bytes")
    args = parser.parse_args(argv)
    path = write_corpus(args.out, args.max_bytes, args.repeat_to_bytes)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
