"""convbert_ds: pretrain ConvBERT the ELECTRA way with DeepSpeed; export HuggingFace checkpoints."""

__version__ = "0.1.0"
