"""Quantize: a Hugging Face model into an NVFP4A16 checkpoint in the compressed-tensors format. ``run`` is the
command (``python -m qerl.quantize``; ``llm-compressor/quantize_nvfp4.py`` its front); ``pipeline`` streams it (or
hands it to llm-compressor); ``source`` checks what it reads, ``target`` where it may write; ``mse``, ``importance``
and ``calibration`` are the methods beyond round-to-nearest."""
