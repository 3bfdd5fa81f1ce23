"""Pretrained vs random init, fine-tuned by transformers' own classes only (an oracle beside convbert_ds.finetune).

    python benchmarks/hf_finetune_check.py --model hf/discriminator --task-dir runs/transfer/data/task

(``--task-dir``: the task ``benchmarks/pretraining_transfer.py`` builds in WORK/data/task, or any folder of
train.jsonl and validation.jsonl with ``text`` and ``label``.)

Nothing of convbert_ds is imported: ``transformers.ConvBertForSequenceClassification`` loads the converted
directory (``from_pretrained``) or is built from its config.json with fresh weights (random init, same
architecture and tokenizer), and a plain loop trains both the way a new user would: AdamW (weight decay
0.01), linear warm-up (10%) and decay, batch 32, max length 32, no layer-wise decay. Every learning rate
runs every seed; a model's score is its best learning rate by median dev accuracy ("best of"), so
neither side is judged at a rate that suits only the other.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoTokenizer, ConvBertConfig, ConvBertForSequenceClassification, get_linear_schedule_with_warmup

from convbert_ds.cli import ArgumentParser, bounded, exit_on_user_error


def read_split(path: Path) -> tuple[list[str], list[str]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["text"] for r in rows], [r["label"] for r in rows]


def encode(tokenizer, texts: list[str], labels: list[str], label_ids: dict[str, int], max_length: int) -> dict:
    batch = tokenizer(texts, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt")
    batch["labels"] = torch.tensor([label_ids[label] for label in labels])
    return dict(batch)


def finetune_once(model_dir: Path, random_init: bool, train: dict, dev: dict, num_labels: int, lr: float,
                  seed: int, epochs: int, batch_size: int) -> float:
    torch.manual_seed(seed)
    if random_init:
        config = ConvBertConfig.from_pretrained(model_dir, num_labels=num_labels)
        model = ConvBertForSequenceClassification(config)
    else:
        model = ConvBertForSequenceClassification.from_pretrained(model_dir, num_labels=num_labels)
    no_decay = ("bias", "LayerNorm.weight")
    groups = [{"params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)], "weight_decay": 0.01},
              {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=lr)
    count = len(train["labels"])
    total = epochs * ((count + batch_size - 1) // batch_size)
    schedule = get_linear_schedule_with_warmup(optimizer, int(0.1 * total), total)
    order = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        model.train()
        for idx in torch.randperm(count, generator=order).split(batch_size):
            loss = model(**{k: v[idx] for k, v in train.items()}).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        predicted = torch.cat([model(**{k: v[i:i + 256] for k, v in dev.items() if k != "labels"}).logits.argmax(-1)
                               for i in range(0, len(dev["labels"]), 256)])
    return float((predicted == dev["labels"]).float().mean())


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a HuggingFace ConvBERT directory with tokenizer")
    parser.add_argument("--task-dir", type=Path, required=True, help="train.jsonl and validation.jsonl (text, label)")
    parser.add_argument("--learning-rates", default="3e-4,1e-3")
    parser.add_argument("--seeds", type=bounded(int, min=1), default=3)
    parser.add_argument("--epochs", type=bounded(int, min=1), default=4)
    parser.add_argument("--batch-size", type=bounded(int, min=1), default=32)
    parser.add_argument("--max-length", type=bounded(int, min=1), default=32)
    parser.add_argument("--threads", type=bounded(int, min=1), default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()  # the load report lists the new head as missing: expected
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train_texts, train_labels = read_split(args.task_dir / "train.jsonl")
    dev_texts, dev_labels = read_split(args.task_dir / "validation.jsonl")
    label_ids = {label: i for i, label in enumerate(sorted(set(train_labels)))}
    train = encode(tokenizer, train_texts, train_labels, label_ids, args.max_length)
    dev = encode(tokenizer, dev_texts, dev_labels, label_ids, args.max_length)
    started = time.perf_counter()
    scores: dict[tuple[str, float], list[float]] = {}
    for lr in (float(x) for x in args.learning_rates.split(",")):
        for init in ("pretrained", "random init"):
            scores[init, lr] = [finetune_once(args.model, init == "random init", train, dev, len(label_ids), lr,
                                              seed, args.epochs, args.batch_size) for seed in range(args.seeds)]
            s = scores[init, lr]
            print(f"{init:<12} lr {lr:g}: dev accuracy median {statistics.median(s):.3f} "
                  f"[{min(s):.3f}, {max(s):.3f}] over {args.seeds} seeds", flush=True)
    best = {init: max(((lr, s) for (i, lr), s in scores.items() if i == init), key=lambda x: statistics.median(x[1]))
            for init in ("pretrained", "random init")}
    (p_lr, p), (r_lr, r) = best["pretrained"], best["random init"]
    print(f"\ntransformers' ConvBertForSequenceClassification, {args.epochs} epochs, best learning rate each "
          f"({time.perf_counter() - started:.0f} s):\n  pretrained  {statistics.median(p):.3f} (lr {p_lr:g})\n"
          f"  random init {statistics.median(r):.3f} (lr {r_lr:g})\n"
          f"  margin      {statistics.median(p) - statistics.median(r):+.3f}; pretrained seeds above the best "
          f"random seed: {sum(x > max(r) for x in p)}/{len(p)}")


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
