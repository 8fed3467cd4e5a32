"""Quantize a Hugging Face model to NVFP4A16 (compressed-tensors), the checkpoint qerl and vLLM load.

    python llm-compressor/quantize_nvfp4.py --model smollm2-135m
    python llm-compressor/quantize_nvfp4.py --model Qwen/Qwen2.5-7B-Instruct --output qmodel/qwen7b

The reference's script name, kept as the command users run: a thin front of ``qerl.quantize.run`` (flags, defaults
and the command's docs there; ``python -m qerl.quantize`` runs the same). It imports the installed ``qerl``
(``bash setup_env.sh`` installs the checkout).
"""

import sys

if __name__ == "__main__":
    from qerl.cli import ctrl_c_ends_the_imports

    ctrl_c_ends_the_imports("")  # before the seconds of imports below: a Ctrl-C there is one line too
    from qerl.quantize.run import main

    sys.exit(main())
