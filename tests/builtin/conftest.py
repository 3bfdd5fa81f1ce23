"""Built-in corpus and task tests: each task's files (balanced, disjoint, deterministic, naming no label) and the
pretraining corpus they are held out of. They build their inputs from the installed files, no fixture needed."""
