"""How pending samples become engine calls (no model; instant)."""

from __future__ import annotations

from eval.data import Problem
from eval.runner import plan_engine_calls


def test_calls_share_prefill_and_respect_batch_size() -> None:
    a, b, c, d = (Problem(i, f"q{i}", "1") for i in range(4))
    # b was interrupted after two of its four samples; the others have all four pending.
    pending = [(a, s) for s in range(4)] + [(b, 2), (b, 3)] + [(c, s) for s in range(4)] + [(d, s) for s in range(4)]
    calls = plan_engine_calls(pending, batch_size=8)
    assert calls == [[(a, [0, 1, 2, 3]), (c, [0, 1, 2, 3])], [(d, [0, 1, 2, 3])], [(b, [2, 3])]]
    # Every pending sample lands in exactly one call; a call never mixes sample counts.
    flat = sorted((p.index, s) for call in calls for p, samples in call for s in samples)
    assert flat == sorted((p.index, s) for p, s in pending)
    assert all(len({len(samples) for _, samples in call}) == 1 for call in calls)
    # A batch smaller than K still makes progress, one question per call.
    assert [len(call) for call in plan_engine_calls(pending, batch_size=2)] == [1, 1, 1, 1]
