"""Benchmark script tests: the scripts under ``benchmarks/`` run end to end as users start them, on a tiny
budget (the root conftest's ``tiny_corpus`` for shards); they check the machinery and the report, not the
numbers a full run would measure. Here the user benchmarks; in ``gpu/`` the GPU acceptance and its lease, in
``analysis/`` the kernel-analysis tools, as ``benchmarks/`` splits them."""
