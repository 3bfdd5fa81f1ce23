"""Quickstart: the whole pipeline on built-in real text, on 2 CPU ranks, in a few minutes.

1. corpus: the Python standard library's docstrings (real English every Python ships);
2. ``preprocessing.tokenizer``: a sentencepiece tokenizer trained on it;
3. ``preprocessing.shard``: megatron-core token shards + manifest;
4. ``deepspeed --num_gpus 2 --module convbert_ds.train``: a tiny ConvBERT ELECTRA with ZeRO-2,
   printing the losses falling;
5. ``convbert_ds.convert``: the checkpoint as HuggingFace ConvBERT directories, verified
   against transformers.

Rerunning resumes training from the last checkpoint (raise ``--steps`` to train longer).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from convbert_ds.data.builtin_corpus import write_corpus

REPO = Path(__file__).resolve().parent.parent


def _run(command: list[str]) -> None:
    print("$ " + " ".join(command), flush=True)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    subprocess.run(command, check=True, cwd=REPO, env=env)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", default="runs/quickstart", help="where everything is written")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--ranks", type=int, default=2, help="processes for the deepspeed launcher")
    parser.add_argument("--vocab-size", type=int, default=8000)
    args = parser.parse_args(argv)
    work = Path(args.work_dir).resolve()
    python = sys.executable

    corpus = work / "corpus.txt"
    if not corpus.exists():
        write_corpus(corpus)
    print(f"corpus: {corpus} ({corpus.stat().st_size / 1e6:.1f} MB of standard-library docstrings)", flush=True)
    tokenizer, shards = work / "tokenizer", work / "shards"
    if not (tokenizer / "tokenizer.json").exists():
        _run([python, "-m", "preprocessing.tokenizer", "--input", str(corpus), "--out", str(tokenizer),
              "--vocab-size", str(args.vocab_size)])
    if not (shards / "manifest.json").exists():
        _run([python, "-m", "preprocessing.shard", "--input", str(corpus), "--tokenizer", str(tokenizer),
              "--out", str(shards), "--valid-fraction", "0.05"])

    checkpoints, logs = work / "checkpoints", work / "logs"
    _run([str(Path(python).parent / "deepspeed"), "--num_gpus", str(args.ranks), "--module", "convbert_ds.train",
          "--config", str(REPO / "configs" / "tiny_cpu.yaml"),
          f"data.sets=[{{path: '{shards}', weight: 1.0}}]", f"checkpoint.dir={checkpoints}", f"log.dir={logs}",
          "deepspeed.config=ds_configs/zero2_bf16.json", "train.precision=fp32", f"train.steps={args.steps}",
          "train.warmup_steps=60", "checkpoint.interval=200", "eval.interval=200", "log.interval=25"])

    rows = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    head, tail = train[:3], train[-3:]
    mean = lambda group, key: sum(r[key] for r in group) / len(group)  # noqa: E731
    print(f"\nloss {mean(head, 'loss'):.2f} -> {mean(tail, 'loss'):.2f} "
          f"(generator MLM {mean(head, 'mlm_loss'):.2f} -> {mean(tail, 'mlm_loss'):.2f}, "
          f"discriminator RTD {mean(head, 'rtd_loss'):.3f} -> {mean(tail, 'rtd_loss'):.3f})")
    print(f"checkpoints: {checkpoints}  (latest: {(checkpoints / 'latest').read_text().strip()})")
    print(f"logs: {logs} (TensorBoard events, metrics.jsonl; plot: python -m convbert_ds.plot {logs})\n")

    hf = work / "hf"
    _run([python, "-m", "convbert_ds.convert", "--checkpoint", str(checkpoints), "--out", str(hf), "--verify",
          "--force"])
    print(f"HuggingFace ConvBERT: {hf / 'discriminator'} (AutoModel) and {hf / 'generator'} "
          f"(AutoModelForMaskedLM), with their tokenizer")


if __name__ == "__main__":
    main()
