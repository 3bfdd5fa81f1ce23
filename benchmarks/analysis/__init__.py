"""Kernel-analysis tools (``python benchmarks/analysis/NAME.py``), kept apart: no user benchmark imports them."""
