"""The benchmarks: scripts users run at the top, the GPU acceptance in gpu/, kernel-analysis tools in analysis/."""
