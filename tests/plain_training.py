"""A plain PyTorch ELECTRA loop over the real data path (no DeepSpeed): the model tests' training runs."""

from __future__ import annotations

from collections.abc import Callable

import torch

from convbert_ds.config import ElectraConfig
from convbert_ds.model import ElectraForPretraining


def train_plain(shards, steps: int, seq_len: int = 64, batch_size: int = 16, lr: float = 1e-3,
                config: Callable[[int], ElectraConfig] | None = None, autocast: bool = False) -> list[dict]:
    """Per-step ``metrics()`` of ``steps`` AdamW steps from seed 0 on the shards' train split. ``config``: the
    model for a vocabulary size (default: the tiny preset); ``autocast``: the forward under CPU bf16 autocast."""
    from convbert_ds.data.loader import build_dataloader
    from convbert_ds.data.shards import open_split

    vocab_size = open_split(shards, "train").vocab_size
    torch.manual_seed(0)
    model = ElectraForPretraining(config(vocab_size) if config else
                                  ElectraConfig.from_preset("tiny", vocab_size=vocab_size,
                                                            max_position_embeddings=seq_len))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
    loader = build_dataloader([{"path": shards}], "train", seq_len=seq_len, micro_batch_size=batch_size, seed=0,
                              progress=False)
    history = []
    for _, batch in zip(range(steps), loader):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(**batch)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        optimizer.step()
        history.append(out.metrics())
    return history
