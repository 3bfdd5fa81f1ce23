"""ConvBERT models (transformers-compatible names) and ELECTRA pretraining."""

from convbert_ds.model.convbert import (ConvBertForMaskedLM, ConvBertForPreTraining, ConvBertForQuestionAnswering,
                                        ConvBertForSequenceClassification, ConvBertForTokenClassification,
                                        ConvBertModel, InputError)
from convbert_ds.model.electra import ElectraForPretraining, PretrainingOutput, mask_tokens
from convbert_ds.model.hf_io import WeightsError
from convbert_ds.model.sdconv import dynamic_conv, dynamic_conv_reference

__all__ = [
    "ConvBertForMaskedLM", "ConvBertForPreTraining", "ConvBertForQuestionAnswering",
    "ConvBertForSequenceClassification", "ConvBertForTokenClassification", "ConvBertModel",
    "ElectraForPretraining", "InputError", "PretrainingOutput", "WeightsError", "dynamic_conv",
    "dynamic_conv_reference", "mask_tokens",
]
