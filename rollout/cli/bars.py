"""A progress bar of items done with the tokens/s and the time left, shared by the commands that
generate (`rollout generate`: prompts; `rollout eval`: rows, a task per suite)."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class TokenRateBar:
    """Items done out of a total, tokens/s since the current task started, elapsed and left."""

    def __init__(self, console: Console, unit: str):
        self.bar = Progress(
            TextColumn("[bold]{task.description} {task.completed:.0f}/{task.total:.0f} " + unit),
            BarColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
        )
        self.task = None
        self.tokens = 0
        self.started = 0.0
        self.running = False

    def add_task(self, description: str, total: int, completed: int = 0) -> None:
        """A new task (shown under the earlier ones); its tokens/s count from now."""
        if not self.running:
            self.bar.start()
            self.running = True
        self.task = self.bar.add_task(description, total=total, completed=completed, rate="")
        self.tokens, self.started = 0, time.perf_counter()

    def update(self, done: int, new_tokens: int) -> None:
        self.tokens += new_tokens
        elapsed = time.perf_counter() - self.started
        rate = f"{self.tokens / elapsed:.1f} tok/s" if self.tokens and elapsed > 0 else ""
        self.bar.update(self.task, completed=done, rate=rate)

    def stop(self) -> None:
        if self.running:
            self.bar.stop()
            self.running = False
