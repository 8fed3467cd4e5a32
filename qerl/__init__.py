"""qerl: reinforcement-learning post-training of LLMs on 4-bit NVFP4 weights.

The pipeline, one package per step: quantize (``qerl.quantize``) -> load (``qerl.load``) -> kernels
(``qerl.kernels``) -> rollout (``qerl.rollout``) <-> train (``qerl.train``) -> evaluate (``eval``). The top level
keeps what several steps share (``nvfp4`` the format, ``checkpoint`` its files, ``arch`` the model families,
``fsutil``, ``runlock``, ``hub``, ``cli``), ``export``, and the public names ``qerl.trainer`` and ``qerl.plot``.
"""

import sys
from typing import Any

__all__ = ["NVFP4Linear", "load_model", "load_tokenizer"]
__version__ = "0.1.0"

if sys.argv[:1] == ["-m"]:  # ``python -m qerl.<command>`` is importing its command: a Ctrl-C now is one line too
    from qerl.cli import ctrl_c_ends_the_imports

    ctrl_c_ends_the_imports(__name__)


def __getattr__(name: str) -> Any:
    """The public names, imported on first use. ``python -m qerl.train`` (any ``qerl.X`` command) imports this package
    before the command's own code runs: imported here, torch and transformers (seconds) would load before the
    command starts, on every command, even ``--help``."""
    if name == "NVFP4Linear":
        from qerl.load.linear import NVFP4Linear

        return NVFP4Linear
    if name in ("load_model", "load_tokenizer"):
        from qerl.load import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'qerl' has no attribute {name!r}")
