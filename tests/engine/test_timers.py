"""The breakdown's bookkeeping: regions per category, "other" as the remainder, covered vs uncovered steps."""

import pytest

from spanllm.engine.timers import CATEGORIES, Breakdown, Timers, fold_step


def test_fold_step_remainder_and_per_step():
    """The all-reduce runs inside a row-parallel linear's "gemm" region (the model's one call site of the
    communicator): it is taken out of gemm, so nothing is counted twice."""
    b = Breakdown()
    fold_step(b, {"gemm": 2.0, "attention": 1.0, "allreduce": 0.5, "pipeline": 0.0, "idle": 0.0, "other": 0.0}, 4.0)
    fold_step(b, {"gemm": 4.0, "attention": 1.0, "allreduce": 0.5, "pipeline": 0.0, "idle": 0.0, "other": 0.0}, 4.5)
    assert b.steps == 2 and b.total_ms == 8.5
    assert b.per_step() == {
        "gemm": 2.5,  # (1.5 + 3.5) / 2
        "attention": 1.0,
        "allreduce": 0.5,
        "pipeline": 0.0,
        "idle": 0.0,
        "other": 0.5,
    }  # (1.0 + 0.0) / 2: a step whose regions exceed it (5.0 in 4.5) adds no negative rest


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


class _FakeEvent:
    """A CUDA event on a fake clock: record() advances time by 1 ms, a spin by 10 ms; query() answers
    whether the last spin has finished as the test sets it."""

    clock = 0.0
    spin_finished = False

    def __init__(self, enable_timing: bool = False) -> None:
        self.t = None

    def record(self) -> None:
        _FakeEvent.clock += 1.0
        self.t = _FakeEvent.clock

    def elapsed_time(self, other: "_FakeEvent") -> float:
        return other.t - self.t

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return _FakeEvent.spin_finished


def _fake_spin(cycles: int) -> None:
    _FakeEvent.clock += 10.0


def test_gpu_path_excludes_spins_and_sorts_steps_by_coverage(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "_sleep", _fake_spin)
    t = Timers("cuda", enabled=True, layer_spins=True)

    def step():
        t.step_begin()  # start 1, spin 2..13
        t.layer_begin()  # spin 14..25
        with t.region("gemm"):  # 26..27
            pass
        t.layer_begin()  # spin 28..39
        t.step_end()  # end 40

    _FakeEvent.spin_finished = False  # every spin still running when the host moved on: covered
    step()
    assert t.breakdown.steps == 1 and t.uncovered.steps == 0
    # total 40 - 1 = 39 ms minus three spins of 11 ms (event to event) = 6 ms; gemm 1 ms, the rest "other"
    assert t.breakdown.total_ms == 6.0 and t.breakdown.ms["gemm"] == 1.0 and t.breakdown.ms["other"] == 5.0
    _FakeEvent.spin_finished = True  # the GPU caught up with the host: the step is kept apart
    step()
    assert t.breakdown.steps == 1 and t.uncovered.steps == 1 and t.uncovered.total_ms == 6.0


def test_layer_begin_is_a_no_op_outside_a_step_and_without_layer_spins(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda c: pytest.fail("spun outside a timed step"))
    Timers("cuda", enabled=True, layer_spins=True).layer_begin()  # not in a step
    t = Timers("cuda", enabled=True, layer_spins=False)
    _FakeEvent.spin_finished = False
    monkeypatch.setattr(torch.cuda, "_sleep", _fake_spin)
    t.step_begin()
    monkeypatch.setattr(torch.cuda, "_sleep", lambda c: pytest.fail("layer spin with layer_spins=False"))
    t.layer_begin()
    t.step_end()
    assert t.breakdown.steps == 1
