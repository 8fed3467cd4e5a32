"""Quantize: a Hugging Face model into an NVFP4A16 checkpoint in the compressed-tensors format.
``pipeline`` streams it (or hands it to llm-compressor); ``source`` checks what it reads, ``target`` where it
writes; ``mse``, ``importance`` and ``calibration`` are the methods beyond round-to-nearest."""
