"""The live display for `leverlab bench` (rich): one bar for the whole run, one for the current phase,
and a running line of the phase's figures."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from leverlab.bench.records import RequestRecord
from leverlab.bench.runner import Phase
from leverlab.bench.runner import Progress as ProgressHooks


class RichProgress(ProgressHooks):
    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            console=self.console,
            transient=False,
        )
        self.total_task = None
        self.phase_task = None
        self.errors = 0
        self.ok = 0

    def start(self, phases: list[Phase], warmup: int) -> None:
        total = sum(len(p.requests) for p in phases) + warmup
        self.bar.start()
        self.total_task = self.bar.add_task("all requests", total=total, info="")

    def phase(self, name: str, total: int) -> None:
        if self.phase_task is not None:
            self.bar.remove_task(self.phase_task)
        self.ok = self.errors = 0
        self.phase_task = self.bar.add_task(name, total=total, info="")

    def request_done(self, rec: RequestRecord) -> None:
        if rec.ok:
            self.ok += 1
        else:
            self.errors += 1
        info = (
            f"last: TTFT {rec.ttft_s * 1000:.0f} ms, E2E {rec.e2e_s:.2f} s, {rec.output_tokens} tok"
            if rec.ok
            else f"error: {(rec.error or '')[:60]}"
        )
        if self.errors:
            info += f"  [red]{self.errors} errors[/red]"
        self.bar.update(self.phase_task, advance=1, info=info)
        self.bar.update(self.total_task, advance=1)

    def phase_done(self, group: dict) -> None:
        e2e = group["e2e_s"]
        self.bar.console.print(
            f"[bold]{group['name']}[/bold]: {group['completed']} ok, {group['errors']} errors, "
            f"E2E P50 {e2e['p50']:.3f} s, TTFT P50 {group['ttft_ms']['p50']:.1f} ms, "
            f"{group['output_throughput']:.1f} out tok/s, {group['request_throughput']:.3f} req/s"
        )

    def stop(self) -> None:
        self.bar.stop()
