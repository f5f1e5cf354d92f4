"""Comparisons timed in turns: the summary's tuned and untuned latencies, and
the kernel check's tuned record against its default schedule, alternate
repeat by repeat, so a machine whose speed drifts slows both alike."""
from types import SimpleNamespace

import pytest

from deploy import runtime
from deploy.tuning import check


def _drifting(calls: list):
    """Fake timers on a machine that gets 10% slower with every repeat, each
    logging its name when it runs."""
    clock = {"slow": 1.0}

    def timer(name: str, seconds: float):
        def one():
            calls.append(name)
            clock["slow"] *= 1.1
            return seconds * clock["slow"]
        return one

    return timer


class _FakeTimer:
    """runtime.Timer's interface: a call is one repeat's seconds per run."""

    def __init__(self, one, number: int, repeat: int):
        self.one, self.number, self.repeat = one, number, repeat

    def __call__(self) -> float:
        return self.one()


def test_latencies_alternate_and_keep_their_own_statistics():
    calls: list = []
    timer = _drifting(calls)
    timers = [_FakeTimer(timer("a", 0.010), 7, 3), _FakeTimer(timer("b", 0.010), 9, 10)]
    got = runtime.latency_in_turns(timers)
    assert calls == ["a", "b"] * 10  # the most repeats either asks for, in turns
    ta, tb = got
    assert (ta["number"], tb["number"], ta["repeat"], tb["repeat"]) == (7, 9, 10, 10)
    # the same module on a drifting machine: in turns, within one step of drift of each other
    assert tb["median_ms"] / ta["median_ms"] == pytest.approx(1.1)
    assert ta["min_ms"] == pytest.approx(10 * 1.1) and ta["max_ms"] > ta["median_ms"] > ta["min_ms"]
    assert runtime.latency_in_turns(timers, repeat=2)[0]["repeat"] == 2 and calls[-4:] == ["a", "b", "a", "b"]


def test_the_kernel_check_times_the_record_and_the_default_in_turns(monkeypatch):
    calls: list = []
    timer = _drifting(calls)

    def lib(name):
        f = timer(name, 1e-4)

        def time_evaluator(fn, dev, number, repeat):
            assert (fn, repeat) == ("main", 1)  # one repeat a call: the turns are ours
            if number == 1:  # the probe that sizes a repeat (~TIMING_REPEAT_MS of calls)
                return lambda *args: SimpleNamespace(mean=1e-4)
            assert number == 200
            return lambda *args: SimpleNamespace(mean=f())

        return SimpleNamespace(time_evaluator=time_evaluator)

    monkeypatch.setattr(check, "TIMING_REPEATS", 5)
    tuned_us, default_us = check._time_us_in_turns([lib("tuned"), lib("default")], [[], []], None)
    assert calls == ["tuned", "default"] * 5
    assert default_us / tuned_us == pytest.approx(1.1)  # equal kernels judged equal, give or take one step of drift
    calls.clear()
    assert check._time_us(lib("alone"), [], None) > 0 and calls == ["alone"] * 5
