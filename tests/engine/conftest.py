"""Engine tests: the typed config and its resolution, the DeepSpeed files, real training on 2 gloo ranks
(every ZeRO stage, pipeline, MPI, resume after kill -9) and the downstream probes; launches go through
``launch.py`` (a timed-out launch kills its whole process group). Most are marked ``slow``."""
