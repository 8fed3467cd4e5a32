"""Load: an NVFP4A16 checkpoint into a transformers model whose linear layers keep their weights packed
(``loader``, ``linear``), peft LoRA over them (``lora``), and the checks that guard what is read: headers against
the model's config (``headers``), finite scales in range (``integrity``) and the content digests an adapter
records of its base (``fingerprint``)."""
