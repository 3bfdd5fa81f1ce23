"""A training checkpoint as a format of its own, read without DeepSpeed.

- ``directory``: ``checkpoint.dir``'s tags, the ``COMPLETE`` manifest, which tag to resume from;
- ``run_state``: ``trainer_state.json``, the run's own state in each tag (step, sampler, phase, layout,
  config), typed and versioned;
- ``rng``: every rank's random-number states;
- ``names``: one map of parameter names between the plain model, pipeline layers and universal copies;
- ``universal``: a checkpoint's weights and Adam state read out of any ZeRO / pipeline layout, and the
  layout-free copy the trainer reshapes from.

``convbert_ds.engine`` writes and loads these during training; the converter and fine-tuning read
them from here.
"""
