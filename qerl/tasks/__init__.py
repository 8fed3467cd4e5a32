"""Tasks: what a model is asked and how its answer is judged, shared by quantize (calibration prompts), train
(data, rewards, held-out accuracy) and eval, so that a model is calibrated, trained and scored on one definition.
``prompts`` the prompt styles and bounded chat templates, ``answers`` the one reading of an answer, ``data_sets``
the named training data sets (where they live, their prompt style, rewards, answer reading and completion budget).
It stands below every stage: nothing here imports quantize, load, rollout, train or eval."""
