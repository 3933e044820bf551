"""GGUF checkpoints (llama.cpp's single-file format): config, tokenizer and weights from one file.

Everything is read with the maintained ``gguf`` package (ggml-org's gguf-py):

- :mod:`.file` finds and opens the file;
- :mod:`.config` maps its metadata to a :class:`~pdserve.model.config.ModelConfig`;
- :mod:`.tokenizer` rebuilds the tokenizer from the ``tokenizer.ggml.*`` keys;
- :mod:`.weights` reads the tensors into :class:`~pdserve.model.weights.ModelWeights`
  (block-quantized ones as :class:`~pdserve.model.quantized.QuantizedTensor`).
"""
