"""Downstream fine-tuning of any ConvBERT model: GLUE and custom tasks, the paper's recipe, a random-init baseline.

    python -m convbert_ds.finetune --model MODEL_DIR --glue-task rte --data-dir glue/RTE --out runs/rte [--seeds 5]
    python -m convbert_ds.finetune --model MODEL_DIR --train train.jsonl --validation dev.jsonl \
        --text-column text --label-column label --out runs/mytask [--random-init]

``tasks``: readers (official GLUE files; TSV/CSV/JSONL/``save_to_disk`` through ``datasets``);
``metrics``: GLUE's metrics; ``recipe``: the hyper-parameters (ConvBERT Table 6 + ELECTRA);
``model_source``: a transformers directory or a training checkpoint; ``loop``: one seed;
``run``: the seeds and what lands in OUT (layout there).
"""
