"""bench.run_case's interleaved rounds, on the CPU (timing functions replaced)."""

import pytest

from cupyrope import bench


def _case(label="[4,128,256]"):
    return bench.Case(op="rms_fwd", label=label, dtype="bfloat16", make=lambda: {}, bytes_moved=1 << 20,
                      reference=None, size=1)


@pytest.fixture
def timings(monkeypatch):
    """name -> GPU µs of its successive rounds; records the order in which providers were timed."""
    plan, order = {}, []

    def gpu_time_us(torch, fns, capture=True):
        name = fns[0]()
        order.append(name)
        return plan[name][sum(n == name for n in order) - 1]

    monkeypatch.setattr(bench, "gpu_time_us", gpu_time_us)
    monkeypatch.setattr(bench, "eager_time_us", lambda torch, fns: 10.0)
    monkeypatch.setattr(bench, "check", lambda *args: None)
    return plan, order


def _providers(*names):
    return {name: (lambda d, name=name: (lambda: name)) for name in names}


def test_short_calls_take_turns_and_keep_medians(timings):
    plan, order = timings
    plan.update({"cupyrope": [2.0, 9.0, 2.2], "liger": [2.1, 2.3, 8.0]})
    results = bench.run_case(None, _case(), _providers("cupyrope", "liger"), rounds=3)
    assert order == ["cupyrope", "liger", "liger", "cupyrope", "cupyrope", "liger"]  # a different first each round
    assert {r.provider: r.gpu_us for r in results} == {"cupyrope": 2.2, "liger": 2.3}


def test_long_calls_are_timed_once(timings):
    plan, order = timings
    plan.update({"cupyrope": [300.0], "liger": [500.0]})
    results = bench.run_case(None, _case(), _providers("cupyrope", "liger"), rounds=3)
    assert order == ["cupyrope", "liger"]
    assert [r.gpu_us for r in results] == [300.0, 500.0]


def test_a_peer_that_fails_when_timed_is_left_out(timings):
    plan, _ = timings
    plan.update({"cupyrope": [2.0, 2.0, 2.0]})
    results = bench.run_case(None, _case(), _providers("cupyrope", "broken"), rounds=3)
    assert [r.provider for r in results] == ["cupyrope"]


def test_a_case_no_provider_can_run_gives_no_results(timings):
    def failing(d):
        raise RuntimeError("unsupported shape")

    assert bench.run_case(None, _case(), {"peer": failing}, rounds=3) == []
