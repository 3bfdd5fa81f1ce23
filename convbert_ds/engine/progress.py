"""Where a run stands in wall-clock terms: the time stamp, elapsed time and ETA on every log line, and the
one-line summary at the end of a run.

The ETA divides the steps left by the pace of this process's own steps so far (a resumed run does not
count the steps it inherited, which another job ran at another pace), so it is honest after the first
log line and settles as the run goes on.
"""

from __future__ import annotations

import datetime
import math
import time


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
        self.samples_per_s: list[float] = []
        self.mfu: list[float] = []
        self.best_valid_loss = math.inf

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def eta(self, step: int) -> float | None:
        done = step - self.start_step
        return None if done <= 0 else (self.total_steps - step) * self.elapsed() / done

    def prefix(self) -> str:
        """What every log line starts with: the wall clock."""
        return f"[{datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S')}]"

    def suffix(self, step: int) -> str:
        """What a step or eval line ends with: elapsed time of this process and the ETA to the last step."""
        eta = self.eta(step)
        return f"elapsed {clock(self.elapsed())} | ETA {'?' if eta is None else clock(eta)}"

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
