"""The engine's thread governor (``backend.allocator.ThreadGovernor``) and the OpenMP wait policy, on a fake
clock and a fake run-queue counter (no torch): one thread while the stepping thread waits on a run queue,
all cores again after a probe finds the machine free, probes backing off while it stays busy."""

from __future__ import annotations

from backend.allocator import ThreadGovernor, openmp_wait_policy


class FakeMachine:
    """A clock and a run-delay counter: ``advance(dt, busy)`` lets ``dt`` seconds pass, of which the
    stepping thread waited ``busy * dt`` on a run queue."""

    def __init__(self) -> None:
        self.now = 100.0
        self.delay = 0.0
        self.set_calls: list[int] = []

    def advance(self, dt: float, busy: float) -> None:
        self.now += dt
        self.delay += busy * dt


def make(m: FakeMachine) -> ThreadGovernor:
    return ThreadGovernor(
        m.set_calls.append,
        2,
        window_s=0.5,
        contended=0.25,
        probe_s=5.0,
        run_delay=lambda: m.delay,
        clock=lambda: m.now,
    )


def run(g: ThreadGovernor, m: FakeMachine, seconds: float, busy: float, step: float = 0.01) -> None:
    for _ in range(round(seconds / step)):
        m.advance(step, busy)
        g.tick()


def test_free_machine_keeps_all_threads():
    m = FakeMachine()
    g = make(m)
    run(g, m, 30, busy=0.05)
    assert g.threads == 2 and m.set_calls == []


def test_contention_drops_to_one_thread_within_a_window_and_probes_back():
    m = FakeMachine()
    g = make(m)
    run(g, m, 0.6, busy=0.6)
    assert g.threads == 1 and m.set_calls == [1]
    run(g, m, 4.0, busy=0.0)  # free again, but no probe before probe_s
    assert g.threads == 1
    run(g, m, 1.5, busy=0.0)
    assert g.threads == 2 and m.set_calls == [1, 2]  # the probe found it free
    run(g, m, 20, busy=0.0)
    assert g.threads == 2 and g.probe_s == 5.0


def test_probes_back_off_while_the_machine_stays_busy():
    m = FakeMachine()
    g = make(m)
    run(g, m, 60, busy=0.6)
    assert g.threads in (1, 2)
    # probes at ~5, 10, 20, 40 s after each drop: 4 probes in a minute, not 12
    assert m.set_calls.count(2) <= 4, m.set_calls
    assert g.probe_s >= 40.0


def test_no_schedstat_no_change():
    m = FakeMachine()
    g = ThreadGovernor(m.set_calls.append, 2, run_delay=lambda: None, clock=lambda: m.now)
    for _ in range(100):
        m.now += 0.1
        g.tick()
    assert g.threads == 2 and m.set_calls == []


def test_openmp_wait_policy():
    env: dict[str, str] = {}
    assert openmp_wait_policy(env) is None and env == {}  # libgomp's default stays
    assert openmp_wait_policy(env, "passive") == "PASSIVE" and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"GOMP_SPINCOUNT": "1000"}
    assert openmp_wait_policy(env) is None and env == {"GOMP_SPINCOUNT": "1000"}
