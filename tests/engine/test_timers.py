"""The breakdown's bookkeeping: regions per category, "other" as the remainder, covered vs uncovered steps."""

from spanllm.engine.timers import CATEGORIES, Breakdown, Timers, fold_step


def test_fold_step_remainder_and_per_step():
    b = Breakdown()
    fold_step(b, {"gemm": 2.0, "attention": 1.0, "allreduce": 0.5, "pipeline": 0.0, "idle": 0.0, "other": 0.0}, 4.0)
    fold_step(b, {"gemm": 4.0, "attention": 1.0, "allreduce": 0.5, "pipeline": 0.0, "idle": 0.0, "other": 0.0}, 5.0)
    assert b.steps == 2 and b.total_ms == 9.0
    assert b.per_step() == {"gemm": 3.0, "attention": 1.0, "allreduce": 0.5, "pipeline": 0.0, "idle": 0.0,
                            "other": 0.25}  # (0.5 + 0.0) / 2: a step whose regions exceed it adds no negative rest


def test_cpu_timers_count_every_step_as_covered():
    t = Timers("cpu", enabled=True)
    for _ in range(3):
        t.step_begin()
        with t.region("gemm"):
            pass
        t.step_end()
    assert t.breakdown.steps == 3 and t.uncovered.steps == 0 and t.steps == 3
    assert set(t.breakdown.ms) == set(CATEGORIES)
    with t.region("gemm"):  # outside a step: a no-op
        pass
    t.reset()
    assert t.steps == 0
