"""ELECTRA pretraining on DeepSpeed's pipeline engine: the plain model's layers, arranged in stages.

``build_pipeline_module(config, num_stages)`` returns a ``deepspeed.pipe.PipelineModule`` whose layers
compute, in order, what ``ElectraForPretraining.forward`` computes; on the same weights, batch and
random stream its loss and metrics are the plain model's (``tests/engine/test_pipeline.py``).

Layers (ELECTRA; the indices of the ``tiny`` preset, whose bodies have 2 layers and need projections):

==  ===========================================  ==================================================
 0  MaskingLayer: mask_tokens                     -
 1  shared embeddings of the masked tokens        ``discriminator.convbert.embeddings.``
 2  generator embeddings_project (if E != H)      ``generator.convbert.embeddings_project.``
 3  generator ConvBertLayer 0, 1, ...             ``generator.convbert.encoder.layer.{i}.``
 5  GeneratorHead: MLM transform + output bias    ``generator.`` (``generator_predictions.*``,
                                                  ``generator_lm_head.bias``)
 6  shared table as the generator's output        - (no file: the table is layer 1's, which is also
    (MLM loss, Gumbel sample, corrupt), then as   ``generator.generator_lm_head.weight`` and
    the discriminator's embeddings                ``generator.convbert.embeddings.*``)
 7  discriminator embeddings_project (if E != H)  ``discriminator.convbert.embeddings_project.``
 8  discriminator ConvBertLayer 0, 1, ...         ``discriminator.convbert.encoder.layer.{i}.``
10  RTDHead                                       ``discriminator.discriminator_predictions.``
==  ===========================================  ==================================================

A DeepSpeed pipeline checkpoint holds ``layer_{index:02d}-model_states.pt`` per layer (``layer_00``'s
is empty; layer 6 writes none); key ``k`` of a file is the plain parameter ``prefix + k``.
``pipeline_layer_names(config)`` in ``convbert_ds.formats.checkpoint.names`` gives every prefix for any
config (the projections exist only where embedding and hidden widths differ); indices do not depend on
the number of stages, which only decides which stage runs each layer. The ``mlm`` objective ends at
layer 6 (output layer only) and its shared embeddings are ``generator.convbert.embeddings.``.

Every layer passes one tuple to the next: a ``NamedTuple`` of ``layers.py`` (which explains its form,
an int64 ``[fields, B, T]`` tensor then the floats), holding what the rest of the step needs after that
layer. The data iterator's labels are empty: nothing the loss needs comes from the last stage's own batch.
"""

from convbert_ds.engine.pipeline.layers import draw_stream_seed
from convbert_ds.engine.pipeline.module import (METRIC_NAMES, build_pipeline_module, check_pipeline_ds_config,
                                                load_plain_state_dict, pipeline_batch, pipeline_metrics)

__all__ = [
    "METRIC_NAMES", "build_pipeline_module", "check_pipeline_ds_config", "draw_stream_seed",
    "load_plain_state_dict", "pipeline_batch", "pipeline_metrics",
]
