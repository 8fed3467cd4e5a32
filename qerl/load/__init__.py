"""Load: an NVFP4A16 checkpoint into a transformers model whose linear layers keep their weights packed
(``loader``, ``linear``), peft LoRA over them (``lora``), and the checks that guard what is read: headers against
the model's config (``headers``), finite scales in range (``integrity``) and what an adapter directory may hold
(``adapter``). What a model directory may hold (``qerl.model_files``, ``qerl.config_fields``) and the digests an
adapter records of its base (``qerl.fingerprint``) are shared with quantize, train, eval and export, a floor down."""
