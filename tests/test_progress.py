"""The progress reporter: time-throttled lines with rate and ETA, driven by a fake clock."""

from fedskew.progress import ProgressReporter, format_duration


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_reports_first_step_then_at_most_once_per_interval_and_always_the_last():
    clock, lines = FakeClock(), []
    report = ProgressReporter("site 3: generator 2/4 s3c1", items_per_step=64, interval_s=20, clock=clock, emit=lines.append)
    for step in range(1, 101):  # one step per 1.5 s: 150 s in all
        clock.now += 1.5
        report(step, 100, loss=1.0 / step)
    # First step, then every 20 s of fake time (a step lands on a multiple of 1.5 s: every 14 steps = 21 s), then the last.
    steps = [int(line.split("step ")[1].split("/")[0]) for line in lines]
    assert steps == [1, 15, 29, 43, 57, 71, 85, 99, 100]
    assert all(b - a >= 20 / 1.5 for a, b in zip(steps[:-2], steps[1:-1]))


def test_line_states_rate_eta_and_loss_from_the_clock():
    clock, lines = FakeClock(), []
    report = ProgressReporter("gen", items_per_step=64, interval_s=20, clock=clock, emit=lines.append)
    clock.now += 30.0
    report(10, 40, loss=0.25)
    # 10 steps x 64 images in 30 s = 21.3 images/s; 30 steps left at 3 s each = 90 s.
    assert lines == ["gen: step 10/40, loss 0.2500, 21.3 images/s, elapsed 30s, ETA 1m30s"]
    clock.now += 90.0
    report(40, 40, loss=0.125)
    assert lines[-1] == "gen: step 40/40, loss 0.1250, 21.3 images/s, elapsed 2m00s"


def test_format_duration():
    assert [format_duration(s) for s in (0, 59.4, 61, 3600 + 62)] == ["0s", "59s", "1m01s", "1h01m02s"]


def test_work_counted_in_images_says_so():
    clock, lines = FakeClock(), []
    report = ProgressReporter("synthesising", counted="image", interval_s=20, clock=clock, emit=lines.append)
    clock.now += 4.0
    report(100, 400)
    # 100 images in 4 s; 300 left at 0.04 s each = 12 s.
    assert lines == ["synthesising: image 100/400, 25.0 images/s, elapsed 4s, ETA 12s"]
