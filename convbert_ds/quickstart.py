"""Quickstart: pretrain a tiny ConvBERT ELECTRA on real text in a few minutes on a CPU.

Everything comes from the Python installation itself: the corpus is the
standard library's docstrings (``convbert_ds.data.builtin_corpus``), the
tokenizer is trained on it with sentencepiece, and training runs in this
process with plain PyTorch. It prints the generator's MLM loss falling and the
discriminator's replaced-token accuracy rising.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import sentencepiece as spm
import torch

from convbert_ds.config import ElectraConfig
from convbert_ds.data.builtin_corpus import iter_documents, write_corpus
from convbert_ds.model import ElectraForPretraining

PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4


def train_sentencepiece(corpus: Path, out_dir: Path, vocab_size: int) -> spm.SentencePieceProcessor:
    out_dir.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(out_dir / "spm"), vocab_size=vocab_size, model_type="unigram",
        pad_id=PAD, unk_id=UNK, bos_id=-1, eos_id=-1, user_defined_symbols=["[CLS]", "[SEP]", "[MASK]"],
        unk_piece="[UNK]", pad_piece="[PAD]", hard_vocab_limit=False, minloglevel=2, num_threads=2)
    return spm.SentencePieceProcessor(model_file=str(out_dir / "spm.model"))


def pack_documents(tokenizer: spm.SentencePieceProcessor, seq_len: int, max_bytes: int | None
                   ) -> list[list[int]]:
    """One sample per document chunk: [CLS] tokens [SEP], at most ``seq_len`` long."""
    samples = []
    for paragraphs in iter_documents(max_bytes):
        ids = [t for p in paragraphs for t in tokenizer.encode(p)]
        for start in range(0, len(ids), seq_len - 2):
            chunk = ids[start:start + seq_len - 2]
            if len(chunk) >= 8:
                samples.append([CLS, *chunk, SEP])
    return samples


def collate(samples: list[list[int]], seq_len: int) -> dict[str, torch.Tensor]:
    input_ids = torch.full((len(samples), seq_len), PAD, dtype=torch.long)
    for row, sample in enumerate(samples):
        input_ids[row, :len(sample)] = torch.tensor(sample)
    return {"input_ids": input_ids, "attention_mask": (input_ids != PAD).long()}


def train(work_dir: Path, steps: int = 300, batch_size: int = 16, seq_len: int = 64, vocab_size: int = 4000,
          lr: float = 1e-3, seed: int = 0, log_every: int = 25, max_bytes: int | None = None) -> list[dict]:
    """Train and return per-step metrics."""
    torch.manual_seed(seed)
    corpus = write_corpus(work_dir / "corpus.txt", max_bytes=max_bytes)
    tokenizer = train_sentencepiece(corpus, work_dir / "tokenizer", vocab_size)
    samples = pack_documents(tokenizer, seq_len, max_bytes)
    random.Random(seed).shuffle(samples)
    config = ElectraConfig.from_preset("tiny", vocab_size=tokenizer.get_piece_size(), max_position_embeddings=seq_len)
    model = ElectraForPretraining(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
    history = []
    start = time.perf_counter()
    for step in range(steps):
        offset = (step * batch_size) % max(len(samples) - batch_size, 1)
        batch = collate(samples[offset:offset + batch_size], seq_len)
        out = model(**batch)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        optimizer.step()
        history.append(out.metrics())
        if log_every and (step % log_every == 0 or step == steps - 1):
            m = history[-1]
            print(f"step {step:4d}  loss {m['loss']:7.3f}  gen mlm {m['mlm_loss']:6.3f}  "
                  f"disc rtd {m['rtd_loss']:6.4f}  mlm acc {m['mlm_accuracy']:.3f}  "
                  f"rtd acc {m['rtd_accuracy']:.3f}  ({time.perf_counter() - start:5.1f}s)", flush=True)
    return history


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", default="runs/quickstart")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    history = train(Path(args.work_dir), steps=args.steps)
    first, last = history[:25], history[-25:]
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    print(f"generator MLM loss {mean(first, 'mlm_loss'):.3f} -> {mean(last, 'mlm_loss'):.3f}; "
          f"discriminator RTD accuracy {mean(first, 'rtd_accuracy'):.3f} -> {mean(last, 'rtd_accuracy'):.3f}")


if __name__ == "__main__":
    main()
