"""qerl: reinforcement-learning post-training of LLMs on 4-bit NVFP4 weights.

The pipeline, one package per step: quantize (``qerl.quantize``) -> load (``qerl.load``) -> kernels
(``qerl.kernels``) -> rollout (``qerl.rollout``) <-> train (``qerl.train``) -> evaluate (``eval``). The top level
keeps what several steps share (``nvfp4`` the format, ``checkpoint`` its files, ``arch`` the model families,
``fsutil``, ``runlock``, ``hub``, ``cli``), ``export``, and the public names ``qerl.trainer`` and ``qerl.plot``.
"""

from qerl.load.linear import NVFP4Linear
from qerl.load.loader import load_model, load_tokenizer

__all__ = ["NVFP4Linear", "load_model", "load_tokenizer"]
__version__ = "0.1.0"
