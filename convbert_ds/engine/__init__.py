"""The training engine: the resolved config, the trainer, checkpoints, the pipeline engine, metrics."""
