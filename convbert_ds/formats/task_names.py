"""The names downstream tasks go by, for every command that takes one: the training config's
``eval.downstream`` (checked before a run starts) and ``python -m convbert_ds.finetune``.

GLUE's tasks are named as transformers' and the ``datasets`` hub name them (lower case, no dash); how
each one's files look is ``convbert_ds/finetune/tasks.py``'s business.
"""

GLUE_TASKS: tuple[str, ...] = ("cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli")
TASK_TYPES: tuple[str, ...] = ("classification", "regression")
