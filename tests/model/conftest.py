"""Model tests: the typed config, ConvBERT against transformers' own (the numerical oracle), ELECTRA,
the SDConv reference. Fixtures: none beyond the root conftest's."""
