"""The GPU acceptance (``python -m benchmarks.gpu.acceptance``) and its helpers; a lease's one command: lease.sh."""
