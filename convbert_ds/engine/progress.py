"""Where a run stands in wall-clock terms: the time stamp, elapsed time and ETA on every log line, and the
one-line summary at the end of a run.

The ETA multiplies the steps left by the recent pace: the seconds a step took over the last ``RECENT``
logging intervals of this process, as the step log timed them (evaluations and saves taken out). The first
interval is left out: it holds the start-up (building the engine, compiling, the first batches), which does
not come again; counted in, it made early ETAs many times too long. Until a second interval is timed the ETA
reads ``estimating``.
"""

from __future__ import annotations

import collections
import datetime
import math
import time

RECENT = 10  # logging intervals the pace is taken over: recent enough to follow a change of speed


def clock(seconds: float) -> str:
    """``3725`` -> ``1:02:05``; days as ``2d 03:00:00``."""
    seconds = max(0, int(round(seconds)))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    return (f"{days}d {hours:02d}:" if days else f"{hours}:") + f"{minutes:02d}:{secs:02d}"


class RunProgress:
    def __init__(self, start_step: int, total_steps: int):
        self.start_step, self.total_steps = start_step, total_steps
        self.started = time.monotonic()
        self.timed_intervals = 0
        self.recent: collections.deque[tuple[int, float]] = collections.deque(maxlen=RECENT)  # (steps, seconds)
        self.samples_per_s: list[float] = []
        self.mfu: list[float] = []
        self.best_valid_loss = math.inf

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def record_pace(self, steps: int, seconds: float) -> None:
        """``steps`` trained in ``seconds`` of training time (one logging interval)."""
        self.timed_intervals += 1
        if self.timed_intervals > 1 and steps > 0:  # the first holds the start-up
            self.recent.append((steps, seconds))

    def eta(self, step: int) -> float | None:
        """Seconds to the last step at the recent pace; None until it is known."""
        if not self.recent:
            return None
        return (self.total_steps - step) * sum(s for _, s in self.recent) / sum(n for n, _ in self.recent)

    def prefix(self) -> str:
        """What every log line starts with: the wall clock."""
        return f"[{datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S')}]"

    def suffix(self, step: int) -> str:
        """What a step or eval line ends with: elapsed time of this process and the ETA to the last step."""
        eta = self.eta(step)
        return f"elapsed {clock(self.elapsed())} | ETA {'estimating' if eta is None else clock(eta)}"

    def record_step(self, metrics: dict) -> None:
        self.samples_per_s.append(metrics["samples_per_s"])
        if metrics.get("mfu") is not None:
            self.mfu.append(metrics["mfu"])

    def record_eval(self, metrics: dict) -> None:
        self.best_valid_loss = min(self.best_valid_loss, metrics.get("loss", math.inf))

    def summary(self, step: int, samples: int, tokens: int) -> str:
        """The run's last line: how far it got, what it saw, how fast (means over the logged steps)."""
        parts = [f"steps {self.start_step}->{step} of {self.total_steps}", f"{samples:,} samples",
                 f"{tokens:,} tokens", f"wall {clock(self.elapsed())}"]
        if self.samples_per_s:
            parts.append(f"mean samples/s {sum(self.samples_per_s) / len(self.samples_per_s):.1f}")
        if self.mfu:
            parts.append(f"mean MFU {sum(self.mfu) / len(self.mfu):.1%}")
        parts.append("best valid loss " + (f"{self.best_valid_loss:.4f}" if math.isfinite(self.best_valid_loss)
                                           else "n/a (no evaluation)"))
        return f"{self.prefix()} summary | " + " | ".join(parts)
