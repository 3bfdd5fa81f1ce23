"""What an evaluation runs: its tasks (read and checked before any job starts), and one job per
(task, init, seed), largest task first."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from convbert_ds.config import ModelConfig
from convbert_ds.evaluate.paper import GLUE, SQUAD
from convbert_ds.finetune.errors import FinetuneError
from convbert_ds.finetune.recipe import Recipe, task_max_seq_length
from convbert_ds.finetune.squad import QATask, read_squad
from convbert_ds.finetune.tasks import TaskData, read_glue

BENCHMARKS = {"glue": GLUE, "squad": SQUAD, "all": GLUE + SQUAD}
# The official downloads' layouts: GLUE's task folders, SQuAD's file names.
GLUE_FOLDERS = {"cola": "CoLA", "sst2": "SST-2", "mrpc": "MRPC", "qqp": "QQP", "stsb": "STS-B", "mnli": "MNLI",
                "qnli": "QNLI", "rte": "RTE", "wnli": "WNLI"}
SQUAD_FILES = {"squad": ("train-v1.1.json", "dev-v1.1.json"), "squad_v2": ("train-v2.0.json", "dev-v2.0.json")}


@dataclass(frozen=True)
class TaskSource:
    """Where one task's files are: what a job needs to read the task again in its own process."""
    name: str
    files: tuple[Path, ...]  # GLUE: (the task's folder,); SQuAD: (train, dev)
    doc_stride: int = 128  # SQuAD: context tokens consecutive windows share

    def read(self) -> TaskData | QATask:
        if self.name in SQUAD:
            train, dev = self.files
            version_2 = self.name == "squad_v2"
            return QATask(self.name, read_squad(train, version_2), {"validation": read_squad(dev, version_2)},
                          {"train": str(train), "validation": str(dev)}, doc_stride=self.doc_stride)
        return read_glue(self.name, self.files[0])

    @property
    def size(self) -> int:
        """Bytes of training data: the order jobs start in, largest first, so that the last to end are short."""
        first = self.files[0]
        return sum(p.stat().st_size for p in first.glob("train*")) if first.is_dir() else first.stat().st_size


@dataclass(frozen=True)
class Job:
    task: TaskSource
    init: str  # "pretrained" or "random"
    seed: int
    model: Path  # a transformers ConvBERT directory
    recipe: Recipe  # the options given (None: the task's default); seeds and first_seed set for this job
    out: Path
    after: str | None = None  # --from-mnli: the MNLI job whose best model this one starts from

    @property
    def name(self) -> str:
        return f"{self.task.name}-{self.init}-seed{self.seed}"

    @property
    def results(self) -> Path:
        return self.out / "results.json"

    @property
    def random_init(self) -> bool:
        """The random-init baseline draws its body, unless it starts from its own MNLI run (``after``)."""
        return self.init == "random" and self.after is None


def task_names(benchmark: str, only: str | None, from_mnli: bool = False) -> tuple[str, ...]:
    """The benchmark's tasks, or the ``--tasks`` among them (comma-separated, any case, GLUE's hyphens kept)."""
    names = _task_names(benchmark, only)
    if from_mnli and "mnli" not in names:
        raise FinetuneError("--from-mnli starts RTE, MRPC and STS-B from MNLI's fine-tuned model: keep mnli among "
                            "the tasks")
    return names


def _task_names(benchmark: str, only: str | None) -> tuple[str, ...]:
    names = BENCHMARKS[benchmark]
    if not only:
        return names
    asked = [t.strip().lower().replace("-", "") for t in only.split(",") if t.strip()]
    unknown = [t for t in asked if t not in names]
    if unknown or not asked:
        raise FinetuneError(f"--tasks {only}: {', '.join(unknown) or 'no task'} is not a task of {benchmark}; "
                            f"use some of {','.join(names)}")
    return tuple(t for t in names if t in asked)


def sources(names: tuple[str, ...], glue_dir: str | None, squad_dir: str | None, doc_stride: int) -> list[TaskSource]:
    found = []
    for name in names:
        if name in SQUAD:
            if not squad_dir:
                raise FinetuneError(f"{name} needs --squad-dir: the folder with {' and '.join(SQUAD_FILES[name])}")
            found.append(TaskSource(name, tuple(Path(squad_dir) / f for f in SQUAD_FILES[name]), doc_stride))
        else:
            if not glue_dir:
                raise FinetuneError("GLUE needs --glue-dir: the folder of the GLUE download, with CoLA/, SST-2/, ... "
                                    "MNLI/ in it")
            found.append(TaskSource(name, (Path(glue_dir) / GLUE_FOLDERS[name],)))
    return found


def check_files(tasks: list[TaskSource]) -> None:
    """Every task read once, before the model is converted or any job starts: a missing folder, a wrong file
    or row ends here, in one line naming it."""
    for source in tasks:
        source.read()


def check_lengths(tasks: list[TaskSource], model: ModelConfig, model_path: str, recipe: Recipe) -> None:
    """The model's positions long enough for each task's length (fine-tuning alone would cut it silently)."""
    for source in tasks:
        wanted = recipe.max_seq_length or task_max_seq_length(source.name)
        if wanted > model.max_position_embeddings:
            raise FinetuneError(
                f"--model {model_path}: max_position_embeddings={model.max_position_embeddings} is shorter than "
                f"{source.name}'s length {wanted} ({'--max-seq-length' if recipe.max_seq_length else 'the recipe'}); "
                f"pass --max-seq-length "
                f"{model.max_position_embeddings} to fine-tune on shorter windows, or a model with longer positions")


# RoBERTa (Liu et al. 2019, section 5.1) and MosaicBERT start these from the MNLI fine-tuned model; the
# ConvBERT and ELECTRA papers fine-tune every task from the pretrained model alone (ConvBERT section 4.2).
FROM_MNLI = ("rte", "mrpc", "stsb")


def jobs(tasks: list[TaskSource], seeds: int, baseline: bool, model: Path, recipe: Recipe, out: Path,
         from_mnli: bool = False) -> list[Job]:
    """Every (task, init, seed), the largest task's first; a seed's pretrained and random-init runs together.
    ``from_mnli``: RTE, MRPC and STS-B start from the best model of the MNLI job with their init and seed."""
    inits = ("pretrained", "random") if baseline else ("pretrained",)
    ordered = sorted(tasks, key=lambda t: -t.size)
    found = []
    for task in ordered:
        for seed in range(recipe.first_seed, recipe.first_seed + seeds):
            for init in inits:
                after = f"mnli-{init}-seed{seed}" if from_mnli and task.name in FROM_MNLI else None
                found.append(Job(task, init, seed, out / "jobs" / after / "best" if after else model,
                                 dataclasses.replace(recipe, seeds=1, first_seed=seed),
                                 out / "jobs" / f"{task.name}-{init}-seed{seed}", after))
    return found


def share(every: list[Job], k: int, n: int) -> list[Job]:
    """The K-th of N shares (``--shard K/N``): round-robin over the largest-first order, so that the shares'
    sizes stay alike; a job that starts from another's model goes with that one."""
    place = {job.name: i % n for i, job in enumerate(every)}
    return [job for job in every if place[job.after or job.name] == k]
