"""Train: GRPO/DAPO over the loaded model. ``run`` is the CLI (``python -m qerl.train``) with its flags in ``args``
(its ``--config`` recipe read by ``recipe``) and ``checkpoint_check`` deciding whether a checkpoint can be resumed;
``trainer`` is the trl drop-in (``QeRLTrainer``, ``QeRLConfig`` from ``config``) and ``rollout_hooks`` the hooks it
overrides to generate with our engines; ``aqn`` the rollout noise, ``is_ratio`` the rollout importance-sampling
ratio, ``recompute`` the memory plan of each training pass (activation recompute, and the rollout engine's cache
freed where the pass needs it), ``memory`` the peak-memory estimate a run is refused with,
``rewards`` the scoring and ``data`` the rows (the answers, prompts and data-set table they read are
``qerl.tasks``'), ``resume`` the run record and ``plot`` the curves. Importing the package imports none of them (trl
is slow to import)."""
