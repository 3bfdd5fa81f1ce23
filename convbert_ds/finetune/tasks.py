"""Fine-tuning data: the official GLUE files, or a custom train/validation pair, read into one shape.

Both readers return a :class:`TaskData`; the training loop never sees a file format. Reading is
strict because a wrong column or a stray label silently ruins a fine-tuning run: every problem is a
:class:`FinetuneError` whose one-line message names the file, the column and the fix.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path

from datasets import ClassLabel, Dataset, DatasetDict, Features, Value, load_dataset, load_from_disk
from datasets.exceptions import DatasetGenerationError

from convbert_ds.finetune.errors import FinetuneError, utf8_text
from convbert_ds.formats.task_names import GLUE_TASKS, TASK_TYPES
from convbert_ds.log import get_logger

log = get_logger(__name__)


@dataclass
class Example:
    text: str
    text_pair: str | None
    label: str | float  # class name (str) for classification, float for regression


@dataclass
class TaskData:
    name: str  # a GLUE task ("cola", "mnli", ...) or "custom"
    task_type: str  # "classification" | "regression"
    label_names: list[str]  # classification: the label vocabulary in a fixed order; regression: []
    train: list[Example]
    evals: dict[str, list[Example]]  # ordered: the first entry is the primary eval split
    metric: str  # primary metric key of metrics.compute_metrics
    source: dict  # where it came from (paths, columns), JSON-serialisable, for results.json
    # The class F1 counts as positive, one of label_names: MRPC's and QQP's official "1", a two-label custom
    # task's --positive-label or its default (choose_positive_label); None where no F1 is reported.
    positive_label: str | None = None


# ---------------------------------------------------------------------------------------------
# GLUE


@dataclass(frozen=True)
class _GlueSpec:
    """How one task's files look in the official GLUE download."""

    title: str  # the benchmark's spelling, for messages
    labels: tuple[str, ...]  # official label order; () for regression
    metric: str
    text: str
    text_pair: str | None
    label: str
    # The official processors take STS-B's and MNLI's label from the row's last field, because
    # MNLI's train and dev files have different numbers of columns before it.
    label_last: bool = False
    header: tuple[str, ...] | None = None  # column names of a file that has no header line (CoLA)
    # QQP's official files contain a few broken rows (question text with line breaks) that the
    # official processor skips; anywhere else a short row means the file is not the official one.
    skip_malformed: bool = False
    evals: tuple[str, ...] = ("dev",)
    positive: str | None = None  # the positive class of the benchmark's F1 (MRPC, QQP)


_BINARY = ("0", "1")
_TWO_WAY_NLI = ("entailment", "not_entailment")
_GLUE = {
    "cola": _GlueSpec("CoLA", _BINARY, "mcc", "sentence", None, "label",
                      header=("source", "label", "original_mark", "sentence")),
    "sst2": _GlueSpec("SST-2", _BINARY, "accuracy", "sentence", None, "label"),
    "mrpc": _GlueSpec("MRPC", _BINARY, "f1", "#1 String", "#2 String", "Quality", positive="1"),
    "qqp": _GlueSpec("QQP", _BINARY, "f1", "question1", "question2", "is_duplicate", skip_malformed=True,
                     positive="1"),
    "stsb": _GlueSpec("STS-B", (), "pearson", "sentence1", "sentence2", "score", label_last=True),
    "mnli": _GlueSpec("MNLI", ("contradiction", "entailment", "neutral"), "accuracy", "sentence1", "sentence2",
                      "gold_label", label_last=True, evals=("dev_matched", "dev_mismatched")),
    "qnli": _GlueSpec("QNLI", _TWO_WAY_NLI, "accuracy", "question", "sentence", "label"),
    "rte": _GlueSpec("RTE", _TWO_WAY_NLI, "accuracy", "sentence1", "sentence2", "label"),
    "wnli": _GlueSpec("WNLI", _BINARY, "accuracy", "sentence1", "sentence2", "label"),
}
if tuple(_GLUE) != GLUE_TASKS:  # the names live in formats/task_names.py, the file layouts here
    raise ImportError(f"finetune/tasks.py describes {tuple(_GLUE)}, formats/task_names.py names {GLUE_TASKS}")
_MAX_MALFORMED_FRACTION = 0.01
_STSB_RANGE = (0.0, 5.0)


def read_glue(task: str, data_dir) -> TaskData:
    """Read a GLUE task's train and dev files exactly as the official download lays them out.

    ``task`` is case-insensitive and may keep the benchmark's hyphen ("SST-2", "STS-B").
    ``data_dir`` is the task's folder: train.tsv and dev.tsv (MNLI: dev_matched.tsv, the primary
    eval split, and dev_mismatched.tsv). Files are read as UTF-8 TSV without quote handling,
    because the texts contain unbalanced quotes that are part of the sentence.
    """
    name = _glue_name(task)
    spec = _GLUE[name]
    root = Path(data_dir)
    files = {split: _glue_file(root, split, spec) for split in ("train", *spec.evals)}
    parsed = {split: _read_glue_file(path, spec) for split, path in files.items()}
    return TaskData(
        name=name, task_type="classification" if spec.labels else "regression", label_names=list(spec.labels),
        train=parsed["train"][0], evals={split: parsed[split][0] for split in spec.evals}, metric=spec.metric,
        source={"kind": "glue", "task": name, "data_dir": str(root.resolve()),
                "files": {split: str(path.resolve()) for split, path in files.items()},
                "columns": {"text": spec.text, "text_pair": spec.text_pair, "label": spec.label},
                "skipped_malformed_rows": {split: skipped for split, (_, skipped) in parsed.items()}},
        positive_label=spec.positive,
    )


def _glue_name(task: str) -> str:
    name = task.strip().lower().replace("-", "")
    if name not in _GLUE:
        raise FinetuneError(f"--glue-task {task}: not a GLUE task; use one of {', '.join(GLUE_TASKS)}, "
                            "or a custom task with --train/--validation")
    return name


def _glue_file(root: Path, split: str, spec: _GlueSpec) -> Path:
    *first, last = [f"{name}.tsv" for name in ("train", *spec.evals)]
    expected = f"{', '.join(first)} and {last}"
    fix = f"point --data-dir at the GLUE {spec.title} folder with {expected} (from the official GLUE download)"
    if not root.is_dir():
        raise FinetuneError(f"--data-dir {root}: directory not found; {fix}")
    path = root / f"{split}.tsv"
    if not path.is_file():
        raise FinetuneError(f"--data-dir {root}: {path.name} not found; {fix}")
    return path


def _read_glue_file(path: Path, spec: _GlueSpec) -> tuple[list[Example], int]:
    """One official file's examples, and how many malformed rows were skipped (QQP only)."""
    fix = f"use the unmodified {path.name} of GLUE {spec.title} from the official GLUE download"
    if path.stat().st_size == 0:
        raise FinetuneError(f"{path}: the file is empty; {fix}")
    # utf8_text allows a byte-order mark: MRPC's files are derived from Microsoft's, which start with one.
    with io.StringIO(utf8_text(path), newline="") as handle:
        rows = csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = list(spec.header) if spec.header else next(rows, [])
        text, text_pair, label = _glue_columns(path, header, spec, fix)
        examples, skipped = [], 0
        for row in rows:
            if not row:  # a blank line, e.g. at the end of the file
                continue
            if len(row) < len(header):
                if not spec.skip_malformed:
                    raise FinetuneError(f"{path}: line {rows.line_num} has {len(row)} tab-separated fields but "
                                        f"the columns are {len(header)} ({', '.join(header)}); {fix}")
                skipped += 1
                continue
            examples.append(Example(row[text], None if text_pair is None else row[text_pair],
                                    _glue_label(path, rows.line_num, row[label], spec, fix)))
    if not examples:
        raise FinetuneError(f"{path}: no examples in the file; {fix}")
    total = len(examples) + skipped
    if skipped > _MAX_MALFORMED_FRACTION * total:
        raise FinetuneError(f"{path}: {skipped} of {total} rows have fewer than {len(header)} fields "
                            f"({', '.join(header)}), more than {_MAX_MALFORMED_FRACTION:.0%}; {fix}")
    return examples, skipped


def _glue_columns(path: Path, header: list[str], spec: _GlueSpec, fix: str) -> tuple[int, int | None, int]:
    """Indices of the text, text-pair and label fields, found by name in the header."""
    for name in filter(None, (spec.text, spec.label, spec.text_pair)):
        if name not in header:
            raise FinetuneError(f"{path}: column '{name}' not found in the header ({', '.join(header)}); {fix}")
    if spec.label_last and header[-1] != spec.label:
        raise FinetuneError(f"{path}: column '{spec.label}' must be the last column of the header, "
                            f"found '{header[-1]}' there; {fix}")
    text_pair = header.index(spec.text_pair) if spec.text_pair else None
    return header.index(spec.text), text_pair, -1 if spec.label_last else header.index(spec.label)


def _glue_label(path: Path, line: int, value: str, spec: _GlueSpec, fix: str) -> str | float:
    if spec.labels:
        if value not in spec.labels:
            raise FinetuneError(f"{path}: line {line}: column '{spec.label}' is {value!r}, not one of "
                                f"{', '.join(spec.labels)}; {fix}")
        return value
    low, high = _STSB_RANGE
    score = _number(value)
    if score is None or not low <= score <= high:
        raise FinetuneError(f"{path}: line {line}: column '{spec.label}' is {value!r}, not a similarity score "
                            f"from {low:g} to {high:g}; {fix}")
    return score


# ---------------------------------------------------------------------------------------------
# Custom tasks

_FORMATS = {".tsv": "tsv", ".csv": "csv", ".jsonl": "json", ".json": "json"}
_SAVED = "save_to_disk"
_SUPPORTED = ".tsv, .csv, .jsonl/.json (JSON lines) or a datasets Dataset.save_to_disk directory"


def read_custom(train, validation, text_column: str, label_column: str, text_pair_column: str | None = None,
                task_type: str | None = None, positive_label: str | None = None) -> TaskData:
    """Read a custom task's train and validation splits through the ``datasets`` library.

    The format follows the path: ``.tsv`` (tab-separated), ``.csv``, ``.jsonl``/``.json`` (JSON
    lines), or a directory written by ``datasets.Dataset.save_to_disk``. TSV/CSV use the usual
    CSV quoting (as pandas and Python's csv module write it) and every column is read as text, so
    that "007" or "NA" stay what they are.

    ``task_type`` None infers it from the train labels, by one rule: "regression" when every
    label is a number (numbers written as text count) and at least one is not a whole number;
    otherwise "classification". So classes coded 0/1/2 stay classes; pass "regression" for
    whole-number scores. Classification labels become strings (0/1 and 1.0 become "0"/"1",
    ``ClassLabel`` values their names) and ``label_names`` is their sorted set from train.
    ``positive_label`` (``--positive-label``): F1's positive class, for two labels only; see
    :func:`choose_positive_label`.
    """
    if task_type not in (None, *TASK_TYPES):
        raise FinetuneError(f"--task-type {task_type}: use classification or regression, or leave it out to "
                            "infer it from the train labels")
    columns = {"--text-column": text_column, "--text-pair-column": text_pair_column, "--label-column": label_column}
    train_split = _read_split("--train", Path(train), columns)
    eval_split = _read_split("--validation", Path(validation), columns)
    inferred = task_type is None
    task_type = _infer_task_type(train_split.labels) if inferred else task_type
    if task_type == "regression":
        train_targets = _regression_labels(train_split, label_column)
        eval_targets = _regression_labels(eval_split, label_column)
        label_names = []
    else:
        train_targets = [_class_name(value) for value in train_split.labels]
        eval_targets = [_class_name(value) for value in eval_split.labels]
        label_names = sorted(set(train_targets))
        _check_seen(eval_split, label_column, eval_targets, set(label_names))
    return TaskData(
        name="custom", task_type=task_type, label_names=label_names, train=train_split.examples(train_targets),
        evals={"validation": eval_split.examples(eval_targets)},
        metric="pearson" if task_type == "regression" else "accuracy",
        positive_label=choose_positive_label(task_type, label_names, positive_label),
        source={"kind": "custom",
                "train": str(train_split.path.resolve()), "validation": str(eval_split.path.resolve()),
                "formats": {"train": train_split.format, "validation": eval_split.format},
                "columns": {"text": text_column, "text_pair": text_pair_column, "label": label_column},
                "task_type_inferred": inferred},
    )


@dataclass
class _Split:
    """One custom split as read, before its labels are interpreted for the task type."""

    flag: str  # the command-line option that named it, for messages
    path: Path
    format: str
    texts: list[str]
    pairs: list[str] | list[None]
    labels: list  # raw values: str, int, float or bool

    def examples(self, targets: list) -> list[Example]:
        return [Example(*fields) for fields in zip(self.texts, self.pairs, targets)]


def _read_split(flag: str, path: Path, columns: dict[str, str | None]) -> _Split:
    fmt = _format(flag, path)
    dataset = _load(flag, path, fmt)
    if len(dataset) == 0:
        raise FinetuneError(f"{flag} {path}: the split has no rows; pass a file with examples")
    for option, column in columns.items():
        if column is not None and column not in dataset.column_names:
            raise FinetuneError(f"{flag} {path}: column '{column}' not found (columns: "
                                f"{', '.join(dataset.column_names)}); pass {option} with one of them")
    text_column, pair_column, label_column = columns.values()
    texts = _texts(flag, path, text_column, dataset[text_column])
    pairs = _texts(flag, path, pair_column, dataset[pair_column]) if pair_column else [None] * len(texts)
    return _Split(flag, path, fmt, texts, pairs, _raw_labels(flag, path, label_column, dataset))


def _format(flag: str, path: Path) -> str:
    if not path.exists():
        raise FinetuneError(f"{flag} {path}: file not found; pass a {_SUPPORTED}")
    if path.is_dir():
        return _SAVED
    if path.suffix.lower() not in _FORMATS:
        raise FinetuneError(f"{flag} {path}: unsupported extension '{path.suffix}'; use {_SUPPORTED}")
    if path.stat().st_size == 0:
        raise FinetuneError(f"{flag} {path}: the file is empty; pass a file with examples")
    return _FORMATS[path.suffix.lower()]


def _load(flag: str, path: Path, fmt: str) -> Dataset:
    if fmt == _SAVED:
        return _load_saved(flag, path)
    try:
        if fmt == "json":
            utf8_text(path)  # datasets keeps another encoding's bytes as text, to fail when a row is read
            return load_dataset("json", data_files=str(path), split="train")
        delimiter = "\t" if fmt == "tsv" else ","
        features = Features({name: Value("string") for name in _delimited_header(flag, path, delimiter)})
        # na_filter=False: an empty field stays "" (reported as empty text) instead of becoming NaN.
        return load_dataset("csv", data_files=str(path), delimiter=delimiter, features=features,
                            na_filter=False, split="train")
    except (ValueError, DatasetGenerationError) as error:
        cause = error.__cause__ or error
        reason = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        raise FinetuneError(f"{flag} {path}: cannot be read as {fmt.upper()} ({reason}); fix the file, or give it "
                            "the extension of its format") from error


def _delimited_header(flag: str, path: Path, delimiter: str) -> list[str]:
    """The column names of a CSV/TSV file; also catches a file with a header and no rows,
    which ``datasets`` would only report as an obscure "corresponds to no data"."""
    with io.StringIO(utf8_text(path), newline="") as handle:
        rows = csv.reader(handle, delimiter=delimiter)
        header = next(rows, [])
        if not any(rows):
            raise FinetuneError(f"{flag} {path}: the split has no rows after the header; pass a file with examples")
    return header


def _load_saved(flag: str, path: Path) -> Dataset:
    try:
        dataset = load_from_disk(str(path))
    except FileNotFoundError as error:
        raise FinetuneError(f"{flag} {path}: this directory was not written by datasets' save_to_disk; pass a "
                            f"{_SUPPORTED}") from error
    if isinstance(dataset, DatasetDict):
        splits = list(dataset)
        raise FinetuneError(f"{flag} {path}: this is a DatasetDict with splits {', '.join(splits)}; pass the "
                            f"split's directory, e.g. {path / splits[0]}")
    return dataset


def _texts(flag: str, path: Path, column: str, values) -> list[str]:
    texts = list(values)
    for row, text in enumerate(texts, start=1):
        if not isinstance(text, str) or not text.strip():
            problem = "is empty" if text is None or isinstance(text, str) else f"is {text!r}, not text"
            raise FinetuneError(f"{flag} {path}: column '{column}' row {row} {problem}; fill in the text or drop "
                                "the row")
    return texts


def _raw_labels(flag: str, path: Path, column: str, dataset: Dataset) -> list:
    """Labels as stored; ``ClassLabel`` ids become their names, since the ids carry no meaning alone."""
    feature = dataset.features[column]
    values = list(dataset[column])
    if isinstance(feature, ClassLabel):
        # -1 is how datasets marks a missing label (e.g. GLUE's test split).
        values = [None if value is None or value < 0 else feature.int2str(value) for value in values]
    for row, value in enumerate(values, start=1):
        if value is None or (isinstance(value, str) and not value.strip()):
            raise FinetuneError(f"{flag} {path}: column '{column}' row {row} has no label; fill it in or drop "
                                "the row")
    return values


def _number(value) -> float | None:
    """The value as a finite float, or None when it is not a number (bools are not numbers here)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            return None
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _infer_task_type(labels: list) -> str:
    numbers = [_number(value) for value in labels]
    if all(number is not None for number in numbers) and any(not number.is_integer() for number in numbers):
        return "regression"
    return "classification"


def _regression_labels(split: _Split, column: str) -> list[float]:
    targets = []
    for row, value in enumerate(split.labels, start=1):
        number = _number(value)
        if number is None:
            raise FinetuneError(f"{split.flag} {split.path}: column '{column}' row {row} is {value!r}, not a "
                                "number; regression needs numeric labels (or pass --task-type classification)")
        targets.append(number)
    return targets


def _class_name(value) -> str:
    """A label as a class name; whole numbers lose their ".0" so 1 and 1.0 name the same class."""
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _check_seen(split: _Split, column: str, labels: list[str], known: set[str]) -> None:
    unseen = [label for label in dict.fromkeys(labels) if label not in known]
    if unseen:
        shown = ", ".join(repr(label) for label in unseen[:5])
        more = f" (+{len(unseen) - 5} more)" if len(unseen) > 5 else ""
        raise FinetuneError(f"{split.flag} {split.path}: column '{column}' has labels not in --train: {shown}{more}; "
                            "the model can only predict train labels, so add examples of them to --train or drop "
                            "those rows")


# ---------------------------------------------------------------------------------------------
# F1's positive class (custom tasks)

# (positive, negative) label pairs whose positive side is plain, compared case-insensitively.
_POSITIVE_PAIRS = (("1", "0"), ("1", "-1"), ("true", "false"), ("yes", "no"), ("positive", "negative"),
                   ("pos", "neg"))
POSITIVE_LABEL_OPTION = "--positive-label"


def default_positive_label(label_names: list[str]) -> tuple[str, str]:
    """A two-label task's positive class when none is asked for, and why, for the log: the positive side of a
    plain pair (1/0, 1/-1, true/false, yes/no, positive/negative, pos/neg, any case), else the label that sorts
    second. Only a pair counts, not a label alone: with 1/2 (e.g. Yelp polarity's negative/positive) "1" is
    not the positive class."""
    by_lower = {name.lower(): name for name in label_names}
    for positive, negative in _POSITIVE_PAIRS:
        if set(by_lower) == {positive, negative}:
            return by_lower[positive], f"the positive side of {by_lower[positive]}/{by_lower[negative]}"
    # Sorting second is what F1 counted before the option; it keeps those runs' numbers.
    return sorted(label_names)[1], "the label that sorts second: the labels are no pair like 1/0, yes/no or true/false"


def choose_positive_label(task_type: str, label_names: list[str], requested: str | None) -> str | None:
    """F1's positive class of a custom task: ``requested`` (``--positive-label``) or, for two labels, the
    default (said in one log line); None where no F1 is reported. A request that cannot apply is refused."""
    option = f"{POSITIVE_LABEL_OPTION} {requested}"
    if task_type == "regression":
        if requested is not None:
            raise FinetuneError(f"{option}: the task is a regression, which has no classes; drop the option, or pass "
                                "--task-type classification if the labels are classes")
        return None
    if len(label_names) != 2:
        if requested is not None:
            raise FinetuneError(f"{option}: the task has {len(label_names)} labels ({_listed(label_names)}); F1, and "
                                "so a positive class, is reported for two labels only; drop the option")
        return None
    if requested is None:
        chosen, why = default_positive_label(label_names)
        log.info(f"note: F1's positive class is {chosen!r} ({why}); choose it with {POSITIVE_LABEL_OPTION}")
        return chosen
    if requested not in label_names:
        raise FinetuneError(f"{option}: not one of the task's labels ({_listed(label_names)}); pass one of them as "
                            "written in the label column")
    return requested


def _listed(labels: list[str]) -> str:
    return ", ".join(repr(label) for label in labels)  # quoted: a label's spaces and case show
