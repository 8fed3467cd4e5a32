"""qerl: reinforcement-learning post-training of LLMs on 4-bit NVFP4 weights.

The pipeline, one module per step:
quantize (``qerl.quantize``) -> load (``qerl.loader``) -> rollout (``qerl.rollout``)
<-> train (``qerl.trainer``, ``qerl.aqn``) -> evaluate (``eval``).
"""

from qerl.linear import NVFP4Linear
from qerl.loader import load_model, load_tokenizer

__all__ = ["NVFP4Linear", "load_model", "load_tokenizer"]
__version__ = "0.1.0"
