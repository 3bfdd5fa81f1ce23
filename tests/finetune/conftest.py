"""Fine-tuning tests: GLUE and custom task readers, metrics, recipes, and real fine-tuning runs (CPU, 2-rank
DDP, resume). The runs are marked ``slow``."""
