"""The built-in corpus and tasks: real text that every installation of this project has, so nothing is downloaded.

``stdlib_docstrings``: the standard library's docstrings as a plain-text corpus. ``docstring_summaries``: a
pretraining corpus of the installed packages' prose and the in-domain task held out of it (which package a
docstring summary documents). ``docstring_questions``: cloze questions over those summaries in SQuAD's layout.
``aws_api_passages``: the out-of-domain task (which AWS service a passage of botocore's API reference documents).
``labelled_splits``: the balanced, disjoint train and validation files the classification tasks are written as.

They are inputs to ``preprocessing`` and fine-tuning, used by the quickstart, the benchmarks and the test fixtures;
they read files (never import them) and import nothing of the training pipeline.
"""
