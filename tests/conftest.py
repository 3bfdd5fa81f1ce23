"""Test-wide settings (offline hubs, Triton's CPU interpreter when there is no GPU) and the fixtures several
test folders share: ``tiny_corpus`` (real preprocessing output), ``cluster`` (a real Slurm cluster) and
``s3`` (a real S3-compatible server).

The folders mirror the package; shared helpers sit here at the top (``launch.py``, ``shard_factory.py``,
``slurm_cluster.py``, ``object_store.py``). TRITON_INTERPRET must be set before triton compiles anything, hence here.
"""

import os
import shutil
import subprocess

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Inductor's scalar C++ kernels (its vectorised ones off) in every test and every process a test starts: what
# the compiled tests check is the graph (no break, the eager numbers) and the machinery around it, not
# inductor's vector code, and with cold caches, as in CI, g++ on the vectorised kernels is about 40% of a
# compile (tests/model/test_compile_random.py: 167 s against 97 s scalar, 2 CPU cores).
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
# For the same reason g++ builds inductor's C++ at -O0 (with debug symbols: torch's one switch for it):
# scalar kernels, no FMA contraction and no fast math at any level, so no level should round differently
# (the compiled tests pass with their tolerances unchanged), and a step's C++ wrapper builds in a third of
# the time (a 1-layer tiny step's forward: 3.3 s against 10.0 s at -O3).
os.environ.setdefault("TORCHINDUCTOR_DEBUG_COMPILE", "1")
# One compute thread per pytest-xdist worker (scripts/test.sh runs one worker per core), and in every process
# a test starts: with each worker's torch on every core, the workers' thread pools contend, and a test that
# trains in-process ran 7x slower beside another worker than alone.
# Inductor compiles in the compiling process itself, not in a pool of its own: each process that compiles
# would start the pool's processes, which import torch and inductor to run g++ beside it, on cores the other
# workers already fill (benchmarks/compile_time.py's test: 190 CPU-seconds in-process, 225 with the pool).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """Real text (the standard library's docstrings), a trained tokenizer, and its shards."""
    from convbert_ds.builtin.stdlib_docstrings import write_corpus
    from preprocessing.shard import shard_corpus
    from preprocessing.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("tiny_corpus")
    corpus = write_corpus(root / "corpus.txt", max_bytes=400_000)
    tokenizer = train_tokenizer([str(corpus)], str(root / "tokenizer"), vocab_size=2000)
    shard_corpus([str(corpus)], str(tokenizer), str(root / "shards"), workers=1, valid_fraction=0.05)
    return {"corpus": corpus, "tokenizer": tokenizer, "shards": root / "shards"}


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """A real one-node Slurm cluster on loopback (tests/slurm_cluster.py), started once for the session
    (the Slurm tests and the converter's Slurm job use it)."""
    from slurm_cluster import SlurmCluster, SlurmUnavailable  # only sessions that run Slurm tests need it

    try:
        with SlurmCluster(tmp_path_factory.mktemp("slurm")) as slurm:  # stops the daemons however we leave
            yield slurm
    except SlurmUnavailable as error:  # only start() raises it: no slurm-wlm and no way to install it
        pytest.skip(str(error))


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server on loopback (tests/object_store.py), started once for the session."""
    from object_store import S3Server

    with S3Server() as server:
        yield server


@pytest.fixture
def s3(s3_server, monkeypatch):
    """The session's S3 server, its variables set for this test and every process it starts."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return s3_server


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(size_bytes, name="disk", leave=None)``: a directory on a real filesystem of that size (a
    tmpfs under ``tmp_path``), for the tests of full disks; with ``leave``, a file ``filler`` there takes all
    but ``leave`` bytes of its room. Skips where this process may not mount (as root on Linux, it can)."""
    mounted = []

    def mount(size: int, name: str = "disk", leave: int | None = None):
        where = tmp_path / name
        where.mkdir(parents=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(where)
        if leave is not None:
            with open(where / "filler", "wb") as f:
                f.write(bytes(max(0, shutil.disk_usage(where).free - leave)))
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture(autouse=True)
def _restore_environment():
    """Give every test the environment it started with.

    A test that runs a command line in-process (``train.main``) has it fill RANK/WORLD_SIZE/MASTER_PORT
    into ``os.environ``, as a launched process would; left there, every later test's subprocesses
    inherited them and took "torch" as their launcher with a world of one.
    """
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def pytest_collection_modifyitems(config, items):
    """The files with the most slow tests first (launches, compiles), each file's tests in their own order.

    scripts/test.sh hands pytest-xdist whole files in this order (``--no-loadscope-reorder``). Its default,
    the files with the most tests first, left the compile and Slurm files (few tests, minutes each) for
    last, and one worker ran them while the other had finished: 1,030 s for the suite, where this order
    simulates to 978 s from the same run's per-test times.
    """
    slow = {}
    for item in items:
        slow[item.path] = slow.get(item.path, 0) + (item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: -slow[item.path])  # stable: a file's tests keep their order


_REPORTED: set[str] = set()  # a failing module fixture fails every test that uses it: print its error once


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Print a failure's tail the moment it happens, not only in the end summary.

    A run cut short (a CI time limit, the OOM killer) never reaches the summary; this way its log still
    says which test failed and why.
    """
    report = (yield).get_result()
    reporter = item.config.pluginmanager.get_plugin("terminalreporter")
    if report.failed and reporter is not None and report.longreprtext not in _REPORTED:
        _REPORTED.add(report.longreprtext)
        reporter.write_line(f"\n--- {report.nodeid} ({report.when}) failed:\n{report.longreprtext[-3000:]}")
