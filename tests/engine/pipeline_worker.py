"""Runs the pipeline engine on several ranks for tests/engine/test_pipeline.py and writes what it saw as JSON.

    torchrun --nproc_per_node 2 tests/engine/pipeline_worker.py {parity|train} OUT_DIR
    torchrun --nproc_per_node 4 tests/engine/pipeline_worker.py topologies OUT_DIR

Every rank writes ``OUT_DIR/rank{r}.json``; the checks live in the test, so a failure shows numbers.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

import deepspeed
import torch
from deepspeed import comm as dist

from convbert_ds.config import ElectraConfig
from convbert_ds.builtin.stdlib_docstrings import iter_documents
from convbert_ds.model import ElectraForPretraining
from convbert_ds.engine.distributed import exit_process, init_process_group
from convbert_ds.engine.pipeline import (
    build_pipeline_module,
    check_pipeline_ds_config,
    draw_stream_seed,
    load_plain_state_dict,
    pipeline_batch,
    pipeline_metrics,
)

PAD, UNK, CLS, SEP = 0, 1, 2, 3
SEQ_LEN, MICRO_BATCH, MICRO_BATCHES = 32, 2, 2
ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
# The plain reference clips as DeepSpeed's ZeRO-1 does; check_pipeline_ds_config rejects clipping with ZeRO-0.
CLIPPING = {0: 0.0, 1: 1.0}
STREAM_SEED = 1234


def ds_config(zero_stage: int, bf16: bool = False, micro_batches: int = MICRO_BATCHES, lr: float = ADAMW["lr"]) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": micro_batches,
        "optimizer": {"type": "AdamW", "params": {**ADAMW, "lr": lr, "betas": list(ADAMW["betas"]),
                                                  "torch_adam": True}},
        "gradient_clipping": CLIPPING[zero_stage],
        "zero_optimization": {"stage": zero_stage},
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**9,
    }
    check_pipeline_ds_config(config)
    return config


def tiny_config(vocab_size: int, objective: str = "electra", dropout: float = 0.0) -> ElectraConfig:
    config = ElectraConfig.from_preset("tiny", vocab_size=vocab_size, max_position_embeddings=SEQ_LEN,
                                       hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    if objective == "mlm":
        config = ElectraConfig(discriminator=config.discriminator, objective="mlm")
    return config


def engine_for(module, ds: dict):
    return deepspeed.initialize(model=module, config=ds,
                                model_parameters=[p for p in module.parameters() if p.requires_grad])[0]


def random_batch(generator: torch.Generator, vocab_size: int, packed: bool = False) -> dict[str, torch.Tensor]:
    """[CLS] words [SEP] then padding; different lengths per row. ``packed``: each row's words are cut into
    documents of random lengths, each starting with [CLS], with their ``document_ids``."""
    input_ids = torch.randint(5, vocab_size, (MICRO_BATCH, SEQ_LEN), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row in range(MICRO_BATCH):
        length = int(torch.randint(SEQ_LEN // 2, SEQ_LEN + 1, (), generator=generator))
        input_ids[row, 0], input_ids[row, length - 1] = CLS, SEP
        input_ids[row, length:], attention_mask[row, length:] = PAD, 0
    token_type_ids = torch.zeros_like(input_ids)
    token_type_ids[:, SEQ_LEN // 2:] = attention_mask[:, SEQ_LEN // 2:]
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
    if packed:
        starts = torch.rand(MICRO_BATCH, SEQ_LEN, generator=generator) < 0.15
        starts[:, 0] = True
        input_ids[starts & (attention_mask == 1)] = CLS
        batch["document_ids"] = starts.long().cumsum(1) * attention_mask
    return batch


def parity_run(objective: str, zero_stage: int, partition_method: str, num_stages: int = 2,
               activation_checkpoint_interval: int = 0, steps: int = 2, packed: bool = False) -> dict:
    """Pipeline vs plain model: same weights, batches and random streams; AdamW steps on both, then an eval step.

    With more ranks than stages the replicas see different batches; the plain model sees all of them.
    """
    vocab_size = 500
    config = tiny_config(vocab_size, objective)
    torch.manual_seed(0)
    plain = ElectraForPretraining(config)
    module = build_pipeline_module(config, num_stages, partition_method=partition_method, seed=STREAM_SEED,
                                   activation_checkpoint_interval=activation_checkpoint_interval, packed=packed)
    load_plain_state_dict(module, plain.state_dict())
    engine = engine_for(module, ds_config(zero_stage))
    optimizer = torch.optim.AdamW(plain.parameters(), **ADAMW)
    replicas = dist.get_world_size() // num_stages
    # The masking layer of replica r runs on its first-stage rank, whose seed is offset by that rank.
    seeds = [torch.Generator().manual_seed(STREAM_SEED + module.topology().get_rank(pipe=0, data=r))
             for r in range(replicas)]
    data = torch.Generator().manual_seed(7)
    result = {"pipe": [], "plain": [], "returned_loss": [], "stage_starts": [int(i) for i in module.parts]}
    for step in range(steps + 1):  # training steps, then one eval_batch
        training = step < steps
        batches = [[random_batch(data, vocab_size, packed) for _ in range(MICRO_BATCHES)] for _ in range(replicas)]
        mine = iter(map(pipeline_batch, batches[module.mpu().get_data_parallel_rank()]))
        loss = engine.train_batch(mine) if training else engine.eval_batch(mine)
        result["returned_loss"].append(float(loss))
        result["pipe"].append(pipeline_metrics(engine))
        plain.train(training)
        outputs = []
        with torch.set_grad_enabled(training):
            for replica, replica_batches in enumerate(batches):
                for batch in replica_batches:
                    torch.manual_seed(draw_stream_seed(seeds[replica]))
                    outputs.append(plain(**batch))
        if training:
            optimizer.zero_grad()
            (sum(out.loss for out in outputs) / len(outputs)).backward()
            if CLIPPING[zero_stage]:
                torch.nn.utils.clip_grad_norm_(plain.parameters(), CLIPPING[zero_stage])
            optimizer.step()
        metrics = [out.metrics() for out in outputs]
        result["plain"].append({k: sum(m[k] for m in metrics) / len(metrics) for k in metrics[0]})
    return result


def checkpoint_run(zero_stage: int, directory: Path) -> dict:
    """Save after one step; the saver's next two steps vs a differently initialised engine that loads.

    The "uniform" split puts the shared table on both stages: the second copy has no layer file.
    """
    vocab_size = 500
    config = tiny_config(vocab_size, dropout=0.1)
    data = torch.Generator().manual_seed(11)
    batches = [[random_batch(data, vocab_size) for _ in range(MICRO_BATCHES)] for _ in range(3)]

    def step(engine, index: int) -> float:
        torch.manual_seed(100 + index)  # dropout and the masking streams
        engine.train_batch(iter(map(pipeline_batch, batches[index])))
        return pipeline_metrics(engine)["loss"]

    torch.manual_seed(0)
    saver = engine_for(build_pipeline_module(config, 2, "uniform"), ds_config(zero_stage))
    step(saver, 0)
    saver.save_checkpoint(str(directory), tag="step1")
    continued = [step(saver, 1), step(saver, 2)]
    torch.manual_seed(1)
    loader = engine_for(build_pipeline_module(config, 2, "uniform"), ds_config(zero_stage))
    fresh = step(loader, 1)
    path, _ = loader.load_checkpoint(str(directory), tag="step1")
    resumed = [step(loader, 1), step(loader, 2)]
    return {"loaded": path is not None, "continued": continued, "resumed": resumed, "fresh": fresh,
            "config": config.to_dict()}


def word_batches(vocab_size: int, count: int) -> list[dict[str, torch.Tensor]]:
    """Real text (the standard library's docstrings), words -> ids by frequency, [CLS] ... [SEP] + padding."""
    documents = [re.findall(r"[a-z]+", " ".join(paragraphs).lower())
                 for paragraphs in iter_documents(max_bytes=300_000)]
    frequent = [w for w, _ in Counter(w for d in documents for w in d).most_common(vocab_size - 5)]
    ids = {w: i + 5 for i, w in enumerate(frequent)}
    samples = []
    for words in documents:
        tokens = [ids.get(w, UNK) for w in words]
        for start in range(0, len(tokens), SEQ_LEN - 2):
            chunk = tokens[start:start + SEQ_LEN - 2]
            if len(chunk) >= 8:
                samples.append([CLS, *chunk, SEP])
    samples = samples[:count * MICRO_BATCH]
    batches = []
    for first in range(0, len(samples), MICRO_BATCH):
        input_ids = torch.full((MICRO_BATCH, SEQ_LEN), PAD, dtype=torch.long)
        for row, sample in enumerate(samples[first:first + MICRO_BATCH]):
            input_ids[row, :len(sample)] = torch.tensor(sample)
        batches.append({"input_ids": input_ids, "attention_mask": (input_ids != PAD).long()})
    return batches


def train_run(steps: int, micro_batches: int, bf16: bool) -> list[dict]:
    vocab_size = 1000
    config = tiny_config(vocab_size, dropout=0.1)
    torch.manual_seed(0)
    engine = engine_for(build_pipeline_module(config, 2), ds_config(1, bf16=bf16, micro_batches=micro_batches, lr=2e-3))
    batches = iter(map(pipeline_batch, word_batches(vocab_size, steps * micro_batches)))
    history = []
    for _ in range(steps):
        engine.train_batch(batches)
        history.append(pipeline_metrics(engine))
    return history


def main() -> None:
    scenario, out_dir = sys.argv[1], Path(sys.argv[2])
    init_process_group()
    rank = dist.get_rank()
    if scenario == "parity":
        result = {
            # "uniform" splits the tiny ELECTRA after the generator head (the random stream and the output
            # bias cross), "parameters" inside the discriminator (the generator's loss crosses).
            "electra_zero0": parity_run("electra", 0, "uniform"),
            "electra_zero1": parity_run("electra", 1, "parameters"),
            "electra_zero1_activation_checkpointing": parity_run("electra", 1, "parameters",
                                                                 activation_checkpoint_interval=1),
            "mlm_zero1": parity_run("mlm", 1, "uniform"),
            "electra_zero1_packed_documents": parity_run("electra", 1, "parameters", packed=True),
            "checkpoint_zero0": checkpoint_run(0, out_dir / "ckpt0"),
            "checkpoint_zero1": checkpoint_run(1, out_dir / "ckpt1"),
        }
    elif scenario == "topologies":  # on 4 ranks
        result = {"four_stages": parity_run("electra", 1, "uniform", num_stages=4),
                  "two_stages_two_replicas": parity_run("electra", 1, "uniform", num_stages=2)}
    elif scenario == "train":
        result = {"fp32": train_run(steps=40, micro_batches=4, bf16=False),
                  "bf16": train_run(steps=3, micro_batches=2, bf16=True)}
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result, allow_nan=True))
    dist.barrier()


if __name__ == "__main__":
    main()
    exit_process(0)  # as the trainer leaves: a finalized gloo group aborts now and then
