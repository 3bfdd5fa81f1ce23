"""An out-of-domain classification task: which cloud service a passage of its API reference documents.

The quickstart's corpus and its in-domain task are Python libraries' docstrings. This task is text of another
domain and length that every installation has and the corpus never reads: the AWS API reference that
botocore (pinned in requirements.txt) ships as JSON service models, written by AWS's writers for cloud
operators. An example is the whole documentation of one operation, structure or field, its HTML reduced to
text, 30 to 120 words (the in-domain summaries are 6 to 40); the label is which of six services of unrelated
purpose it documents. Passages that name a service (its own or another's) are dropped, so a label cannot be
read off a name, and so is a passage found under two labels.

It is the same broad genre as the corpus (reference documentation), so a margin here is evidence of transfer
across domains of technical English, not to news, reviews or conversation.

    python -m convbert_ds.builtin.aws_api_passages --out runs/cloud_docs   # train.jsonl, validation.jsonl
"""

from __future__ import annotations

import gzip
import html
import importlib.metadata
import importlib.util
import json
import re
import sys
from functools import lru_cache
from pathlib import Path

from convbert_ds.builtin.labelled_splits import unambiguous_pool, write_balanced_task
from convbert_ds.cli import ArgumentParser, bounded, exit_on_user_error

# label -> (what the service is for, its folder in botocore/data)
SERVICES: dict[str, tuple[str, str]] = {
    "s3": ("object storage", "s3"),
    "ec2": ("virtual machines and their networks", "ec2"),
    "iam": ("users, roles and permissions", "iam"),
    "dynamodb": ("a key-value database", "dynamodb"),
    "cloudwatch": ("metrics and alarms", "cloudwatch"),
    "cloudformation": ("infrastructure as templates", "cloudformation"),
}
# The services' names and abbreviations; a passage naming any of them is dropped.
_SERVICE_NAME = re.compile(
    r"(?<![A-Za-z0-9])(s3|ec2|iam|dynamodb|cloudwatch|cloud ?formation|simple storage service|elastic compute cloud|"
    r"identity and access management)(?![A-Za-z0-9])", re.IGNORECASE)
MIN_WORDS, MAX_WORDS = 30, 120
_HTML_TAG = re.compile(r"<[^>]+>")


def _service_model(folder: str) -> dict:
    """The newest API version's service model botocore ships for ``folder``."""
    botocore = importlib.util.find_spec("botocore")  # found, not imported: only its data files are read
    versions = sorted((Path(botocore.origin).parent / "data" / folder).iterdir())
    model = versions[-1] / "service-2.json.gz"
    with gzip.open(model, "rt", encoding="utf-8") as stream:
        return json.load(stream)


def _passages(model: dict) -> list[str]:
    """Every documentation string of the model (operations, structures, fields), as plain text."""
    docs = [op.get("documentation", "") for op in model["operations"].values()]
    for shape in model["shapes"].values():
        docs.append(shape.get("documentation", ""))
        docs.extend(member.get("documentation", "") for member in shape.get("members", {}).values())
    # Unescaped first: the models quote XML as escaped markup (``&lt;IsTruncated&gt;``), dropped with the tags.
    return [" ".join(_HTML_TAG.sub(" ", html.unescape(doc)).split()) for doc in docs if doc]


@lru_cache(maxsize=1)
def task_pool() -> dict[str, tuple[str, ...]]:
    """Every usable passage of every service, deduplicated, sorted; a passage of two services is dropped."""
    return unambiguous_pool(((label, text) for label, (_, folder) in SERVICES.items()
                             for text in _passages(_service_model(folder))
                             if MIN_WORDS <= len(text.split()) <= MAX_WORDS and not _SERVICE_NAME.search(text)),
                            SERVICES)


def write_cloud_docs_task(out_dir, train_per_class: int = 60, dev_per_class: int = 60, seed: int = 0) -> dict:
    """Write ``train.jsonl`` and ``validation.jsonl`` ({"text", "label"}), balanced; returns a description.

    60 training passages a service by default: few labelled examples, where a pretrained init should matter.
    """
    counts = write_balanced_task(task_pool(), out_dir, train_per_class, dev_per_class, seed)
    return {"source": "documentation strings of the AWS API models shipped by botocore, labelled by service",
            "classes": {label: description for label, (description, _) in SERVICES.items()},
            "versions": {"botocore": importlib.metadata.version("botocore")}, "counts": counts,
            "per_class": {"train": train_per_class, "validation": dev_per_class},
            "pool_sizes": {label: len(texts) for label, texts in task_pool().items()}, "seed": seed}


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder to write train.jsonl and validation.jsonl to")
    parser.add_argument("--train-per-class", type=bounded(int, min=1), default=60, help="training passages per service")
    parser.add_argument("--dev-per-class", type=bounded(int, min=1), default=60, help="validation passages per service")
    parser.add_argument("--seed", type=bounded(int, min=0), default=0, help="seed of the draw")
    args = parser.parse_args(argv)
    print(json.dumps(write_cloud_docs_task(args.out, args.train_per_class, args.dev_per_class, args.seed), indent=2))


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
