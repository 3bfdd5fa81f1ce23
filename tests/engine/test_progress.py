"""The wall-clock parts of the log: time stamps, elapsed time, ETA and the end-of-run summary."""

import re

from convbert_ds.engine.progress import RunProgress, clock


def test_clock_formats_hours_and_days():
    assert clock(0) == "0:00:00"
    assert clock(3725) == "1:02:05"
    assert clock(2 * 86400 + 3 * 3600 + 7) == "2d 03:00:07"
    assert clock(-5) == "0:00:00"


def test_eta_counts_only_this_processes_steps(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("convbert_ds.engine.progress.time.monotonic", lambda: now[0])
    progress = RunProgress(start_step=100, total_steps=200)  # resumed at step 100
    assert progress.eta(100) is None and progress.suffix(100).endswith("ETA ?")
    now[0] += 50.0  # 10 steps in 50 s: 5 s a step, 90 steps to go
    assert progress.eta(110) == 450.0
    assert progress.suffix(110) == "elapsed 0:00:50 | ETA 0:07:30"
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
