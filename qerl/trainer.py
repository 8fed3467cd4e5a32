"""The trl drop-in's public import path (``from qerl.trainer import QeRLConfig, QeRLTrainer``); the code lives in
``qerl.train.trainer``."""

from qerl.train.trainer import QeRLConfig, QeRLTrainer

__all__ = ["QeRLConfig", "QeRLTrainer"]
