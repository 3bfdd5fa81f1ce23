"""Test-wide settings: offline hubs, and Triton's CPU interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton compiles anything, hence here.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """Real text (the standard library's docstrings), a trained tokenizer, and its shards."""
    from convbert_ds.data.builtin_corpus import write_corpus
    from preprocessing.shard import shard_corpus
    from preprocessing.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("tiny_corpus")
    corpus = write_corpus(root / "corpus.txt", max_bytes=400_000)
    tokenizer = train_tokenizer([str(corpus)], str(root / "tokenizer"), vocab_size=2000)
    shard_corpus([str(corpus)], str(tokenizer), str(root / "shards"), workers=1, valid_fraction=0.05)
    return {"corpus": corpus, "tokenizer": tokenizer, "shards": root / "shards"}


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
