"""A run's compiled graphs kept beside its checkpoints, so that a restart does not compile them again.

torch.compile's inductor caches what it builds on the local disk (``/tmp`` unless
``TORCHINDUCTOR_CACHE_DIR`` says otherwise), which a job restarted on other nodes, or in a fresh container,
does not see: every restart of a compiled run then pays the whole first-step compile again (minutes for
the ConvBERT-base step: ``benchmarks/RESULTS.md``, "time to the first step"), on every node. So the first time
a process has built graphs (its first training step, and its first evaluation where evaluation compiles),
one rank per pipeline stage writes what inductor built or found in its caches in this process
(``torch.compiler.save_cache_artifacts``: the compiled graphs, their Triton kernels bundled with them on
GPUs, and autotuning results). At the next start every rank loads that file
(``torch.compiler.load_cache_artifacts``) before anything compiles, and inductor finds its graphs there.
Torch's own cache keys decide what is a hit (the traced graph, its inputs' shapes and dtypes, torch's
version and configuration, the device), so a stale or foreign file costs a compile, never a wrong kernel.
What is not in the file is redone: Dynamo's tracing of the Python code, AOTAutograd's split into forward and
backward (our autograd Functions keep its cache off), and on CPU the C++ kernels' compile.

On disk, in ``train.compile_cache_dir`` (default: ``compile_cache`` beside the checkpoint directory)::

    torch-{torch version}-{device}-stage{S}-{settings}.bin

where ``device`` is the GPU's name and compute capability (on CPU, ``cpu_`` and its vector ISA), ``S`` the
pipeline stage (0 without a pipeline) and ``settings`` the first 12 hex digits of a sha256 over what shapes
the graphs (``graph_settings``), so that runs of other settings can share a directory and keep their own
files; in the version and the device, characters other than letters, digits and dots become ``_``. A file
holds the bytes ``save_cache_artifacts`` returns, unchanged (torch's format, with its own checksum); it is
written to a temporary name and renamed, so a reader never sees half of one. Deleting the
directory costs one compile. Nothing here can fail a run: a file that cannot be read or written is one
warning line, and the run compiles as it would without it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from convbert_ds.engine.plan import RunPlan
from convbert_ds.fsutil import file_name_part, write_bytes_atomically
from convbert_ds.log import EVERY_RANK, get_logger
from convbert_ds.model.layers import compiled_graph_count

log = get_logger(__name__)


def graph_settings(plan: RunPlan, stage: int) -> dict:
    """What decides the graphs a rank compiles: the networks, the batch's shape, the precision and where it
    is applied, the compile settings and the pipeline stage. (A setting left out only makes two runs share a
    file name: the later one's file replaces the earlier's.)"""
    cfg, ds = plan.cfg, plan.ds_config
    return {"electra": plan.electra.to_dict(), "seq_len": cfg.data.seq_len, "packed": cfg.data.pack_documents,
            "micro_batch_size": plan.micro_batch_size, "precision": plan.precision,
            "weights": {key: ds.get(key, {}).get("enabled", False) for key in ("bf16", "fp16", "torch_autocast")},
            "zero_stage": plan.zero_stage, "cuda_graphs": plan.cuda_graphs,
            "compile": {key: value for key, value in vars(cfg.train).items()
                        if key.startswith("compile") and not key.startswith(("compile_cache", "compile_options"))},
            "activation_checkpointing": cfg.train.activation_checkpointing,
            "pipeline": [cfg.pipeline.stages, stage],
            # by inductor's names, however spelled; only when set, so the names of files written before stay
            **({"compile_options": plan.compile_options} if plan.compile_options else {})}


def device_label() -> str:
    """The device part of a cache file's name: compiled kernels are built for one GPU architecture (or CPU
    vector ISA) and one torch."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return file_name_part(f"{torch.cuda.get_device_name()}-sm{major}{minor}")
    return file_name_part(f"cpu_{torch.backends.cpu.get_cpu_capability()}")


def cache_file(directory: Path, settings: dict, stage: int) -> Path:
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return directory / f"torch-{file_name_part(torch.__version__)}-{device_label()}-stage{stage}-{digest}.bin"


def inductor_cache_use() -> tuple[int, int]:
    """Graphs inductor found in its caches and graphs it compiled, in this process so far."""
    from torch._dynamo.utils import counters  # private but stable: the only record of inductor's cache use
    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


def load_artifacts(path: Path) -> bytes | None:
    """Put the graphs saved in ``path`` into inductor's caches; returns the file's bytes, or None when the
    file is missing or damaged (torch logs why for a damaged one)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    # None, with torch's own warning, when damaged. What it returns otherwise (CacheInfo) changed its fields
    # across torch versions, so it is not read: the first compile's hits say what the file held.
    return None if torch.compiler.load_cache_artifacts(data) is None else data


def built_artifacts() -> bytes | None:
    """What inductor built or found in its caches in this process so far, as the bytes a cache file holds;
    None before anything was compiled."""
    saved = torch.compiler.save_cache_artifacts()
    return None if saved is None else saved[0]


class CompileCache:
    """One rank's side of the cache (module docstring): ``load()`` once, before the first step;
    ``after_step()`` after every step, which writes the file whenever this process has built more graphs
    (otherwise it reads a host-side counter and returns). ``path`` None: off (``train.compile`` or
    ``train.compile_cache`` off)."""

    def __init__(self, path: Path | None, writes: bool):
        self.path, self.writes = path, writes
        self._graphs_seen = 0
        self._on_disk: str | None = None  # the sha256 of the file as this process loaded or last wrote it

    @classmethod
    def for_run(cls, plan: RunPlan, stage: int, writes: bool) -> CompileCache:
        t = plan.cfg.train
        path = cache_file(plan.cfg.compile_cache_dir, graph_settings(plan, stage), stage) \
            if t.compile and t.compile_cache else None
        return cls(path, writes)

    def load(self) -> None:
        if self.path is None:
            return
        try:
            loaded = load_artifacts(self.path)
        except OSError as error:
            self._say(f"warning: train.compile_cache: cannot read {self.path} ({error}); the first step compiles")
            return
        if loaded is not None:
            self._on_disk = hashlib.sha256(loaded).hexdigest()
            self._say(f"compile cache: loaded {self.path} ({len(loaded) / 1e6:.1f} MB)")
        elif self.path.exists():
            self._say(f"warning: train.compile_cache: {self.path} is damaged (torch's warning above says why); "
                      "the first step compiles, and the file is written anew")

    def after_step(self) -> None:
        if self.path is None:
            return
        graphs = compiled_graph_count()
        if graphs <= self._graphs_seen:
            return
        if not self._graphs_seen:
            self._report_first_compile()
        self._graphs_seen = graphs
        data = built_artifacts() if self.writes else None
        digest = None if data is None else hashlib.sha256(data).hexdigest()
        if digest is None or digest == self._on_disk:
            return  # not this rank's file, or a restart that found every graph: the same bytes again
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_bytes_atomically(self.path, data)  # a failed write leaves the old file, and no partial one
        except OSError as error:  # e.g. a full or read-only disk: the run goes on, the next start compiles
            self._say(f"warning: train.compile_cache: cannot write {self.path} ({error}); the next start "
                      "compiles again (set train.compile_cache_dir to a writable directory)")
            return
        self._on_disk = digest
        self._say(f"compile cache: wrote {self.path} ({len(data) / 1e6:.1f} MB; the next start loads it)")

    def _report_first_compile(self) -> None:
        found, built = inductor_cache_use()
        self._say(f"compile: {found} graph(s) found in inductor's caches, {built} compiled")

    def _say(self, line: str) -> None:
        if self.writes:  # the writer of each pipeline stage's file speaks for it
            log.info(line, extra=EVERY_RANK)
