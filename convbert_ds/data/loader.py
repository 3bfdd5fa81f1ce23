"""From ``data.sets`` to a DataLoader: one call for training, one for evaluation.

    train = build_dataloader(cfg.data.sets, "train", seq_len=128, micro_batch_size=32, seed=1234,
                             dp_rank=rank, dp_size=world, consumed_samples=resumed)
    for batch in train: ...            # dict of int64 [micro_batch_size, seq_len] tensors
    client_state["data"] = train.state_dict()       # at checkpoint time
    train.load_state_dict(client_state["data"])     # after loading one (before iterating)

    valid = build_dataloader(cfg.data.sets, "valid", seq_len=128, micro_batch_size=32,
                             dp_rank=rank, dp_size=world, max_samples=4096)
    for batch in valid: ...            # the same batches on every evaluation
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

from convbert_ds.config import ConfigError
from convbert_ds.objstore import is_url
from convbert_ds.data.blending import BlendedDataset
from convbert_ds.data.cross_document import CrossDocumentDataset
from convbert_ds.data.packing import PackedDataset, check_seq_len
from convbert_ds.data.sampler import EvalSampler, PretrainingSampler
from convbert_ds.data.remote_shards import DEFAULT_LIMIT_GB
from convbert_ds.data.shards import check_same_tokenizer, open_split

TRAIN_SPLIT = "train"


def parse_sets(sets) -> list[tuple[Path | str, float]]:
    """``data.sets`` entries: ``{path, weight}`` mappings, ``(path, weight)`` pairs (this function's own
    output: parsing it again changes nothing), or bare paths. A path is a directory or a store URL (kept as
    the string: ``s3://BUCKET/PREFIX``)."""
    if not sets:
        raise ConfigError("data.sets is empty; list at least one shard directory as {path: DIR, weight: 1.0}")
    parsed = []
    for i, entry in enumerate(sets):
        if isinstance(entry, (str, os.PathLike)):
            path, weight = entry, 1.0
        elif isinstance(entry, Mapping):
            unknown = sorted(str(key) for key in entry if key not in ("path", "weight"))
            if unknown or "path" not in entry:
                # {path:DIR} is one key "path:DIR" to YAML, and a misspelt weight would silently be 1.0
                what = f"unknown key(s) {', '.join(map(repr, unknown))}" if unknown else "no 'path'"
                spaced = " (YAML needs a space after each ':')" if any(":" in key for key in unknown) else ""
                raise ConfigError(f"data.sets[{i}] has {what}{spaced}; write it as {{path: SHARD_DIR, weight: 1.0}}")
            path, weight = entry["path"], entry.get("weight", 1.0)
        elif isinstance(entry, tuple) and len(entry) == 2:
            path, weight = entry
        else:
            raise ConfigError(f"data.sets[{i}]={entry!r}: expected a shard directory or {{path: SHARD_DIR, "
                              "weight: 1.0}")
        try:
            weight = float(weight)
        except (TypeError, ValueError):
            weight = math.nan
        if not math.isfinite(weight) or weight <= 0:
            raise ConfigError(f"data.sets[{i}].weight must be a positive number (got {weight!r})")
        parsed.append((str(path) if is_url(path) else Path(path), weight))
    return parsed


def build_dataset(sets, split: str, seq_len: int, seed: int = 1234, num_samples: int | None = None,
                  cache_dir: str | os.PathLike | None = None, progress: bool = True,
                  size_exponent: float = 0.0, pack_documents: bool = False, cache_limit_gb: float = DEFAULT_LIMIT_GB
                  ) -> PackedDataset | CrossDocumentDataset | BlendedDataset:
    """One dataset over ``split`` of every set; blended when there are several, set ``i`` drawn in
    proportion to ``weight_i x len(set_i) ** size_exponent`` (temperature sampling; 0: the weights alone).
    ``pack_documents``: samples hold several documents, with ``document_ids`` (``cross_document.py``).

    Every manifest is checked (and the tokenizers compared) before any index is built.
    """
    check_seq_len(seq_len)
    parsed = parse_sets(sets)
    splits = [open_split(path, split, cache_dir, cache_limit_gb) for path, _ in parsed]
    check_same_tokenizer(splits)
    kind = CrossDocumentDataset if pack_documents else PackedDataset
    datasets = [kind(s, seq_len=seq_len, seed=seed, cache_dir=cache_dir, progress=progress) for s in splits]
    if len(datasets) == 1 and num_samples is None:
        return datasets[0]
    weights = [w * len(d) ** size_exponent for (_, w), d in zip(parsed, datasets)]
    return BlendedDataset(datasets, weights, seed=seed, num_samples=num_samples, cache_dir=cache_dir,
                          progress=progress)


class PretrainingDataLoader:
    """A torch DataLoader plus the sampler state a checkpoint needs.

    Iterating starts at ``sampler.consumed_samples`` and advances it for every
    batch handed out, so ``state_dict()`` counts what training received, not
    what workers prefetched. Iterating again restarts from that count (evaluation
    loaders restart from the beginning).
    """

    def __init__(self, dataset, sampler: PretrainingSampler | EvalSampler, num_workers: int = 0,
                 pin_memory: bool = False):
        self.dataset, self.sampler = dataset, sampler
        # Samples are deterministic, so workers need no randomness; an own generator keeps the
        # DataLoader from drawing worker seeds out of the global RNG, which an exact resume restores.
        self.dataloader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                                      pin_memory=pin_memory, generator=torch.Generator().manual_seed(0))

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for batch in self.dataloader:
            if isinstance(self.sampler, PretrainingSampler):
                self.sampler.advance()
            yield batch

    def __len__(self) -> int:
        """Micro-batches per evaluation pass (training loaders are endless)."""
        if isinstance(self.sampler, PretrainingSampler):
            raise TypeError("a training loader is endless; count steps instead")
        return len(self.sampler)

    @property
    def consumed_samples(self) -> int:
        return getattr(self.sampler, "consumed_samples", 0)

    def state_dict(self) -> dict:
        return self.sampler.state_dict() if isinstance(self.sampler, PretrainingSampler) else {}

    def load_state_dict(self, state: dict) -> None:
        if isinstance(self.sampler, PretrainingSampler):
            self.sampler.load_state_dict(state)


def build_dataloader(sets, split: str = TRAIN_SPLIT, *, seq_len: int, micro_batch_size: int,
                     seed: int = 1234, dp_rank: int = 0, dp_size: int = 1, consumed_samples: int = 0,
                     num_workers: int = 0, pin_memory: bool = False, num_samples: int | None = None,
                     max_samples: int | None = None, cache_dir: str | os.PathLike | None = None,
                     progress: bool = True, size_exponent: float = 0.0,
                     pack_documents: bool = False, cache_limit_gb: float = DEFAULT_LIMIT_GB) -> PretrainingDataLoader:
    """Build the loader for ``split`` of ``sets`` (``data.sets``: ``[{path, weight}, ...]``).

    ``split == "train"``: endless, shuffled per epoch, resumable at ``consumed_samples``.
    Any other split: one fixed, unshuffled pass (at most ``max_samples`` samples,
    evenly spaced over the split), identical on every evaluation.
    ``pack_documents``: batches also hold ``document_ids`` (several documents per sample).
    ``num_samples`` sizes the blend of several sets (default: their total size).
    Sets in a store (URLs) are cached in ``cache_dir``, their token blocks within ``cache_limit_gb``.
    """
    dataset = build_dataset(sets, split, seq_len, seed=seed, num_samples=num_samples, cache_dir=cache_dir,
                            progress=progress, size_exponent=size_exponent, pack_documents=pack_documents,
                            cache_limit_gb=cache_limit_gb)
    if split == TRAIN_SPLIT:
        sampler = PretrainingSampler(len(dataset), micro_batch_size, dp_rank, dp_size, seed,
                                     consumed_samples=consumed_samples)
    else:
        if max_samples is not None and max_samples < len(dataset):
            picks = np.linspace(0, len(dataset), num=max_samples, endpoint=False).astype(np.int64)
            dataset = torch.utils.data.Subset(dataset, picks.tolist())
        sampler = EvalSampler(len(dataset), micro_batch_size, dp_rank, dp_size)
    return PretrainingDataLoader(dataset, sampler, num_workers=num_workers, pin_memory=pin_memory)
