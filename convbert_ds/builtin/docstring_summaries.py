"""A pretraining corpus and a held-out downstream task, both built from installed files.

To show that pretraining helps downstream we need two things that must not
overlap: a pretraining corpus of real English prose larger than the standard
library's docstrings (``stdlib_docstrings``), and a labelled classification task
whose text the pretrained model has never seen. Both are built at run time from
files that every installation of this project has (the standard library and the
packages installed with the project), so nothing third-party is committed.

Task: given the summary (first paragraph) of a function's or class's docstring,
say which library it documents. The labels are seven pinned packages, each a
distinct domain (arrays, plotting, testing, training dashboards, dataset
processing and two kinds of distributed training), close enough that word
counts alone get only part of the way (a bag-of-words classifier:
benchmarks/RESULTS.md#pretraining-transfer); the pins make the task the same on
every installation. Summaries that name any of the libraries are dropped, so a
label cannot be read off its name.

Corpus: the prose paragraphs of every docstring of the standard library and of
the other packages beside the project, the language reference topics CPython
ships (``pydoc_data``) and the prose documentation packages ship (the README in
their ``METADATA``, their ``.md``/``.rst`` files), exact duplicate paragraphs
removed. The task is kept out twice over: its packages and their READMEs are
not read (``TASK_EXCLUDED_NAMES``), and a paragraph containing a run of
``SHINGLE_WORDS`` words of any summary in those packages (all of a shorter
summary) is dropped, which catches docstrings other packages copied from them. The
same filter keeps out the passages of the out-of-domain task (``aws_api_passages``).

Files are parsed (``ast``) or read, never imported, in sorted order, so both
outputs are the same on every run of the same installation.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import sys
import sysconfig
import time
from collections.abc import Collection, Iterable, Iterator
from functools import lru_cache
from pathlib import Path

from convbert_ds.builtin.aws_api_passages import task_pool as cloud_docs_pool
from convbert_ds.builtin.labelled_splits import unambiguous_pool, write_balanced_task
from convbert_ds.builtin.stdlib_docstrings import _DEFINITIONS, _docstrings, _prose_paragraphs, _stdlib_files
from convbert_ds.cli import ArgumentParser, bounded, exit_on_user_error
from convbert_ds.fsutil import write_text_atomically

# label -> (what the library is for, its top-level names in site-packages).
TASK_CLASSES: dict[str, tuple[str, tuple[str, ...]]] = {
    "datasets": ("loading and processing datasets", ("datasets",)),
    "deepspeed": ("memory-efficient distributed training", ("deepspeed",)),
    "matplotlib": ("plotting", ("matplotlib", "mpl_toolkits", "pylab")),
    "megatron": ("model-parallel training of large transformers", ("megatron",)),
    "numpy": ("n-dimensional arrays", ("numpy",)),
    "pytest": ("testing", ("_pytest", "pytest", "py")),
    "tensorboard": ("training dashboards", ("tensorboard",)),
}
# Distribution names (as in ``*.dist-info``) of the task's packages: their READMEs.
_TASK_DISTRIBUTIONS = ("datasets", "deepspeed", "matplotlib", "megatron_core", "numpy", "pytest", "tensorboard")
# Top-level names and distribution names the pretraining corpus must not read.
TASK_EXCLUDED_NAMES: frozenset[str] = frozenset(
    [name for _, names in TASK_CLASSES.values() for name in names] + list(_TASK_DISTRIBUTIONS))

# Library names and their usual aliases; an example naming any of them is dropped.
_LIBRARY_NAME = re.compile(
    r"(?<![A-Za-z])(datasets|deepspeed|matplotlib|mpl|pyplot|plt|megatron|numpy|np|pytest|tensorboard)(?![A-Za-z])",
    re.IGNORECASE)
_MIN_EXAMPLE_WORDS = 6
_MAX_EXAMPLE_WORDS = 40
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")

# A pretraining paragraph sharing this many consecutive words with an excluded summary is dropped.
SHINGLE_WORDS = 8
_TOKEN = re.compile(r"[a-z0-9]+")

# This project's own README is not third-party prose, and would make the corpus change with it.
_OWN_PROJECT = "convbert_ds"
# Test suites' docstrings are mostly terse notes about fixtures.
_SKIP_DIRS = {"test", "tests", "__pycache__"}
_MARKUP_SUFFIXES = (".md", ".rst")
_HTML_TAG = re.compile(r"</?[A-Za-z][^>]*>")
_FENCE = re.compile(r"^(```|~~~).*?^(```|~~~)[^\n]*$", re.MULTILINE | re.DOTALL)
_MARKDOWN_LINK = re.compile(r"\[([^\]\n]*)\]\([^)\s]*\)")
_URL = re.compile(r"<?https?://[^\s>]*>?")
_MIN_WORDS_PER_DOCUMENT = 12


def _site_packages() -> list[Path]:
    """The running interpreter's site-packages folders (one, or two where lib64 differs)."""
    paths = {Path(sysconfig.get_paths()[key]) for key in ("purelib", "platlib")}
    return sorted(p for p in paths if p.is_dir())


def _top_level_name(entry: Path) -> str:
    """Import name of a site-packages entry, or distribution name of a ``.dist-info``."""
    if entry.name.endswith(".dist-info"):
        return entry.name.split("-")[0].lower().replace(".", "_")
    return entry.name.removesuffix(".py")


def _package_files(entry: Path) -> list[Path]:
    """Sorted ``.py`` files of one site-packages entry, without test folders and test files."""
    if entry.is_file():
        return [entry] if entry.suffix == ".py" else []
    files = []
    for dirpath, dirnames, filenames in os.walk(entry):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return [f for f in files if not (f.name.startswith("test_") or f.stem.endswith("_test"))]


def _site_entries(exclude: Collection[str]) -> list[Path]:
    """Site-packages entries to read: everything but ``exclude``, this project and its editable hook."""
    return [entry for root in _site_packages() for entry in sorted(root.iterdir())
            if (name := _top_level_name(entry)) not in exclude and name != _OWN_PROJECT
            and not name.startswith("__editable__")]


# ---------------------------------------------------------------- the task


def _summary(docstring: str) -> str | None:
    """The docstring's first paragraph (its first sentence if the paragraph is long), if it is prose.

    The opening of a docstring is its summary, written for people, and short
    enough for a sentence classifier.
    """
    first = _prose_paragraphs(re.split(r"\n\s*\n", docstring.strip(), maxsplit=1)[0])
    if not first:
        return None
    text = first[0]
    if len(text.split()) > _MAX_EXAMPLE_WORDS:
        text = _SENTENCE_END.split(text, maxsplit=1)[0]
    return text if _MIN_EXAMPLE_WORDS <= len(text.split()) <= _MAX_EXAMPLE_WORDS else None


@lru_cache(maxsize=None)
def _summaries(name: str) -> tuple[str, ...]:
    """Summaries of the class and function docstrings of one site-packages entry (a package or module)."""
    summaries = []
    for root in _site_packages():
        for entry in (root / name, root / f"{name}.py"):
            if entry.exists():
                for path in _package_files(entry):
                    summaries.extend(s for s in map(_summary, _docstrings(path, _DEFINITIONS)) if s is not None)
    return tuple(summaries)


@lru_cache(maxsize=1)
def task_pool() -> dict[str, tuple[str, ...]]:
    """Every usable example of every class, deduplicated, in sorted order.

    Summaries naming a library are dropped. A text found under two labels is
    dropped from both: it cannot be classified, and keeping it would put one
    text in train and dev.
    """
    return unambiguous_pool(((label, text) for label, (_, names) in TASK_CLASSES.items()
                             for name in names for text in _summaries(name) if not _LIBRARY_NAME.search(text)),
                            TASK_CLASSES)


def write_transfer_task(out_dir: str | os.PathLike, train_per_class: int = 500, dev_per_class: int = 100,
                        seed: int = 0) -> dict:
    """Write the task's ``train.jsonl`` and ``validation.jsonl`` (``write_balanced_task``); returns a description."""
    pool = task_pool()
    counts = write_balanced_task(pool, out_dir, train_per_class, dev_per_class, seed)
    return {"source": "first paragraph of class/function docstrings of pinned packages, labelled by package",
            "classes": {label: description for label, (description, _) in TASK_CLASSES.items()},
            "versions": {dist: importlib.metadata.version(dist) for dist in _TASK_DISTRIBUTIONS},
            "counts": counts, "per_class": {"train": train_per_class, "validation": dev_per_class},
            "pool_sizes": {label: len(texts) for label, texts in pool.items()}, "seed": seed}


# ---------------------------------------------------------------- the corpus


def _shingles(text: str) -> set[tuple[str, ...]]:
    """Runs of ``SHINGLE_WORDS`` words of a summary; a shorter summary is one run, all of it."""
    words = tuple(_TOKEN.findall(text.lower()))
    if len(words) <= SHINGLE_WORDS:
        return {words}
    return {words[i:i + SHINGLE_WORDS] for i in range(len(words) - SHINGLE_WORDS + 1)}


@lru_cache(maxsize=4)
def excluded_shingles(exclude: frozenset[str]) -> frozenset[tuple[str, ...]]:
    """Shingles of every summary in the excluded packages (a superset of the task's, whatever the seed) and of
    every passage of the out-of-domain task (``aws_api_passages``), which the corpus must not hold either."""
    held_out = [text for name in sorted(exclude) for text in _summaries(name)]
    held_out += [text for texts in cloud_docs_pool().values() for text in texts]
    return frozenset(s for text in held_out for s in _shingles(text))


def _copies_excluded_text(paragraph: str, banned: frozenset[tuple[str, ...]], lengths: Iterable[int]) -> bool:
    """Whether the paragraph contains a shingle (of one of ``lengths`` words) of an excluded summary."""
    words = tuple(_TOKEN.findall(paragraph.lower()))
    return any(words[i:i + n] in banned for n in lengths for i in range(len(words) - n + 1))


def _pydoc_topics() -> Iterator[str]:
    """The language reference topics CPython ships for ``help()``, one text per topic."""
    path = Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data" / "topics.py"
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            topics = ast.literal_eval(node.value)
            for name in sorted(topics):
                yield topics[name]


def _markup_paragraphs(text: str) -> list[str]:
    """Prose paragraphs of a Markdown or reStructuredText file.

    Code, HTML, tables, headings, directives and templates are dropped, and
    links are reduced to their text, so that what is left reads as prose.
    """
    text = _URL.sub("", _MARKDOWN_LINK.sub(r"\1", _FENCE.sub("", text)))
    return [p for p in _prose_paragraphs(text)
            if not _HTML_TAG.search(p) and "{{" not in p and not p.startswith(("..", "|", "#", "[!", "="))]


def _doc_files(entry: Path) -> list[Path]:
    """The prose documentation one site-packages entry ships: its README or its .md/.rst files."""
    if entry.name.endswith(".dist-info"):
        return [entry / "METADATA"] if (entry / "METADATA").is_file() else []
    if not entry.is_dir():
        return []
    return sorted(p for p in entry.rglob("*") if p.suffix in _MARKUP_SUFFIXES and p.is_file()
                  and not _SKIP_DIRS.intersection(p.relative_to(entry).parts))


def _raw_documents(exclude: Collection[str]) -> Iterator[list[str]]:
    """Documents (prose paragraphs) before deduplication, in a fixed order."""
    for path in _stdlib_files():
        for docstring in _docstrings(path):
            yield _prose_paragraphs(docstring)
    for topic in _pydoc_topics():
        yield _prose_paragraphs(topic)
    entries = _site_entries(exclude)
    for entry in entries:
        for path in _package_files(entry):
            for docstring in _docstrings(path):
                yield _prose_paragraphs(docstring)
    for entry in entries:
        for path in _doc_files(entry):
            text = path.read_text(encoding="utf-8", errors="replace")
            # Of a METADATA file, the long description (the README) after the headers.
            yield _markup_paragraphs(text.partition("\n\n")[2] if path.name == "METADATA" else text)


def iter_pretraining_documents(max_bytes: int | None = None,
                               exclude: Collection[str] = TASK_EXCLUDED_NAMES) -> Iterator[list[str]]:
    """Deduplicated documents without the packages in ``exclude`` or copies of their summaries.

    Stops once ``max_bytes`` of text were yielded.
    """
    banned = excluded_shingles(frozenset(exclude))
    lengths = sorted({len(shingle) for shingle in banned})
    seen: set[str] = set()
    produced = 0
    for paragraphs in _raw_documents(exclude):
        kept = []
        for p in paragraphs:
            if p in seen or _copies_excluded_text(p, banned, lengths):
                continue
            seen.add(p)
            kept.append(p)
        if sum(len(p.split()) for p in kept) < _MIN_WORDS_PER_DOCUMENT:
            continue
        yield kept
        produced += sum(len(p.encode("utf-8")) + 1 for p in kept) + 1
        if max_bytes is not None and produced >= max_bytes:
            return


def write_pretraining_corpus(out: str | os.PathLike, max_bytes: int | None = None,
                             exclude: Collection[str] = TASK_EXCLUDED_NAMES) -> Path:
    """Write the corpus in ``stdlib_docstrings``'s format (a temporary name, then renamed)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(out, "".join("\n".join(paragraphs) + "\n\n"
                                       for paragraphs in iter_pretraining_documents(max_bytes, exclude)))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    corpus = sub.add_parser("corpus", help="write the pretraining corpus (text file)")
    corpus.add_argument("--out", required=True, help="text file to write")
    corpus.add_argument("--max-bytes", type=bounded(int, min=1), default=None, help="stop after about this many bytes")
    task = sub.add_parser("task", help="write the downstream task (train.jsonl, validation.jsonl)")
    task.add_argument("--out", required=True, help="folder to write")
    task.add_argument("--train-per-class", type=bounded(int, min=1), default=500, help="training examples per class")
    task.add_argument("--dev-per-class", type=bounded(int, min=1), default=100, help="validation examples per class")
    task.add_argument("--seed", type=bounded(int, min=0), default=0, help="seed of the example draw")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.command == "corpus":
        path = write_pretraining_corpus(args.out, args.max_bytes)
        text = path.read_text(encoding="utf-8")
        print(f"wrote {path}: {len(text.encode('utf-8')) / 1e6:.1f} MB, {len(text.split()) / 1e6:.2f}M words"
              f" in {time.perf_counter() - start:.0f} s")
    else:
        print(json.dumps(write_transfer_task(args.out, args.train_per_class, args.dev_per_class, args.seed), indent=2))


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
