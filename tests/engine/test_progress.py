"""The wall-clock parts of the log: time stamps, elapsed time, ETA and the end-of-run summary."""

import re

from convbert_ds.engine.progress import RunProgress, clock


def test_clock_formats_hours_and_days():
    assert clock(0) == "0:00:00"
    assert clock(3725) == "1:02:05"
    assert clock(2 * 86400 + 3 * 3600 + 7) == "2d 03:00:07"
    assert clock(-5) == "0:00:00"


def test_eta_is_the_recent_pace_without_the_start_up(monkeypatch):
    """The quickstart's log said ETA 1d 17:14:32 at step 1 and 0:17:57 at step 200 of 1,800 when the 1,600 steps
    left took 7 minutes: the pace was the mean since the start, the compile included."""
    now = [1000.0]
    monkeypatch.setattr("convbert_ds.engine.progress.time.monotonic", lambda: now[0])
    progress = RunProgress(start_step=0, total_steps=1800)
    progress.record_pace(1, 300.0)  # step 1: the start-up and the compile
    assert progress.eta(1) is None and progress.suffix(1).endswith("ETA estimating")
    now[0] += 320.0
    for _ in range(20):  # steps 2-200 in 10-step intervals, 0.25 s a step
        progress.record_pace(10, 2.5)
    assert progress.eta(200) == 1600 * 0.25  # 400 s, not 1600 x 320 / 200
    assert progress.suffix(200) == "elapsed 0:05:20 | ETA 0:06:40"
    for _ in range(10):  # slower now (a longer phase): the last 10 intervals set the pace
        progress.record_pace(10, 5.0)
    assert progress.eta(300) == 1500 * 0.5
    assert re.fullmatch(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\]", progress.prefix())


def test_summary_names_steps_tokens_speed_and_best_validation():
    progress = RunProgress(start_step=0, total_steps=4)
    for samples_per_s, mfu in ((10.0, 0.1), (30.0, 0.3)):
        progress.record_step({"samples_per_s": samples_per_s, "mfu": mfu})
    for loss in (5.0, 4.25, 4.5):
        progress.record_eval({"loss": loss})
    line = progress.summary(4, samples=64, tokens=4096)
    assert " summary | steps 0->4 of 4 | 64 samples | 4,096 tokens | wall 0:00:00 | " in line
    assert line.endswith("mean samples/s 20.0 | mean MFU 20.0% | best valid loss 4.2500")
    quiet = RunProgress(0, 4)
    quiet.record_step({"samples_per_s": 5.0, "mfu": None})
    assert quiet.summary(4, 64, 4096).endswith("mean samples/s 5.0 | best valid loss n/a (no evaluation)")
