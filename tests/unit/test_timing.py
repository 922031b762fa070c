"""IntervalTimer: device events on GPU (read once per step), host time on CPU."""

import time

from megatron_grpo.grpo.timing import IntervalTimer


class FakeEvent:
    """Stands in for torch.cuda.Event: a device clock the test sets by hand."""

    clock_ms = 0.0
    created = []

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None
        self.synced = False
        FakeEvent.created.append(self)

    def record(self):
        self.at = FakeEvent.clock_ms

    def synchronize(self):
        self.synced = True

    def elapsed_time(self, end):
        return end.at - self.at


def test_device_timer_sums_event_pairs_and_syncs_only_when_read():
    timer = IntervalTimer(FakeEvent)
    assert timer.on_device
    for work_ms in (3.0, 5.0):
        with timer.time():
            FakeEvent.clock_ms += work_ms  # the device ran the work; the host returned at once
        FakeEvent.clock_ms += 100.0        # time outside the intervals is not counted
    assert not any(e.synced for e in FakeEvent.created)  # no host sync while timing
    assert abs(timer.total_s() - 0.008) < 1e-12
    assert all(e.synced for e in FakeEvent.created[1::2])
    timer.reset()
    assert timer.total_s() == 0.0


def test_host_timer_measures_wall_time():
    timer = IntervalTimer()
    assert not timer.on_device
    with timer.time():
        time.sleep(0.02)
    assert 0.015 < timer.total_s() < 0.5
