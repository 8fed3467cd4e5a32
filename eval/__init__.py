"""Evaluation of qerl models: ``python -m eval.gsm8k`` and ``python -m eval.math``.

Modules: ``data`` (benchmark files / hub ids), ``prompting`` (prompts tokenized and held to the model's
context before any model work), ``loading`` (base model + LoRA adapter), ``results`` (resumable per-sample JSONL), ``stats`` (pass@k),
``runner`` (the shared loop and flags). Answer extraction and equivalence live in ``qerl.tasks.answers``,
shared with the training rewards.
"""

import sys

if sys.argv[:1] == ["-m"]:  # ``python -m eval.<command>`` is importing its command: a Ctrl-C now is one line too
    from qerl.cli import ctrl_c_ends_the_imports

    ctrl_c_ends_the_imports(__name__)
