"""qerl's benchmarks. Each script runs from the repository root as ``python -m benchmarks.NAME``
(``--help`` for its flags); what they share is in ``benchmarks.common``, and what they measured,
and why, in docs/ (docs/performance.md says how to run each)."""
