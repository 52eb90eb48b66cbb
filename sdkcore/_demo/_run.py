"""The demo's run: the cluster, every scenario under every strategy, the report."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from . import SCENARIO_HELP
from ._memcached import _Wiring, run_outage
from ._memcached_report import NAME as MEMCACHED
from ._memcached_report import planned_requests
from ._report import (
    Progress,
    Report,
    memcached_stream,
    render_head,
    render_row,
    render_slowdown,
    render_strategy,
    summarize,
)
from ._server import TroubledCluster
from ._slowdown import NAME as SLOWDOWN
from ._slowdown import planned_requests as slowdown_requests
from ._slowdown import run_slowdown
from ._workload import SCENARIOS, STRATEGIES, OpResult, run_scenario

__all__ = ["run"]


def _nothing(lines: list[str]) -> None:
    pass


async def run(
    names: Sequence[str],
    *,
    progress: bool = True,
    emit: Callable[[list[str]], None] = _nothing,
    style: Callable[[str], str] = lambda s: s,
    which: Callable[[str], str | None] | None = None,
    telemetry: Any = None,
) -> Report:
    """Run the named scenarios under each strategy against a fresh cluster.

    ``emit`` gets the text report's lines as soon as they are known: the head and
    the scenario list once the cluster listens, each strategy's heading as it
    starts, each scenario's line as it ends, then the memcached scenario's lines as
    it runs (its set-up, each event of its timeline as it happens, its figures as
    each part ends); ``render_text`` of the returned report gives the same lines,
    and the tail after them. ``which`` finds ``memcached`` (default ``shutil.which``).
    ``telemetry`` (an :class:`sdkcore.Telemetry`, or None) is given to every
    orchestrator, channel, breaker and budget of the run; ``report.counts`` is the
    demo's own tally of the same decisions.
    """
    started = time.perf_counter()
    runnable = [s for s in SCENARIOS if s.name in names]
    report = Report(target="")
    for scenario in runnable:
        report.scenario_titles[scenario.name] = scenario.title
    slowdown = SLOWDOWN in names
    if slowdown:
        report.scenario_titles[SLOWDOWN] = SCENARIO_HELP[SLOWDOWN]
    outage = MEMCACHED in names
    if outage:
        report.scenario_titles[MEMCACHED] = SCENARIO_HELP[MEMCACHED]
    total = sum(s.ops for s in runnable) * len(STRATEGIES)
    writes_ok = 0
    wiring = _Wiring(report.counts, telemetry) if outage else None
    async with contextlib.AsyncExitStack() as stack:
        cluster = None
        if runnable:
            cluster = await stack.enter_async_context(TroubledCluster())
            report.target = cluster.target
        emit(render_head(report, total, style))
        bar_total = (
            total + (slowdown_requests() if slowdown else 0) + (planned_requests() if outage else 0)
        )
        with Progress(bar_total, enabled=progress) as bar:
            for n, (label, make) in enumerate(STRATEGIES):
                if cluster is None:
                    break
                table = report.tables.setdefault(label, {})
                emit(render_strategy(label, style))
                every: list[OpResult] = []
                a6_total = a6_hedges = 0
                for scenario in runnable:
                    bar.stage(f"{scenario.name} / {label}")
                    results, a6 = await run_scenario(
                        cluster,
                        scenario,
                        make(),
                        f"s{n}-{scenario.name}",
                        bar.advance,
                        counts=report.counts,
                        telemetry=telemetry,
                    )
                    # the channel's A6 retries: its hedges are not retries (rfc/0008)
                    channel_retries = a6["retries"] - a6["hedges"]
                    table[scenario.name] = summarize(results, channel_retries, a6["hedges"])
                    a6_hedges += a6["hedges"]
                    emit(render_row(scenario.name, table[scenario.name]))
                    every += results
                    a6_total += channel_retries
                    writes_ok += sum(r.ok and r.write for r in results)
                    for r in results:  # the shortest message of each kind reads best
                        if r.error is not None and r.message is not None:
                            seen = report.examples.get(r.error)
                            if seen is None or len(r.message) < len(seen[2]):
                                report.examples[r.error] = (scenario.name, label, r.message)
                table["all"] = summarize(every, a6_total, a6_hedges)
                emit(render_row("all", table["all"]))
            if slowdown:
                bar.stage(SLOWDOWN)
                report.slowdown = await run_slowdown(
                    on_done=bar.advance, counts=report.counts, telemetry=telemetry
                )
                emit(render_slowdown(report, style))
            if outage:
                bar.stage(MEMCACHED)
                lines = memcached_stream(emit, style)
                report.memcached = await run_outage(
                    on_done=bar.advance,
                    which=which,
                    stream=lines,
                    counts=report.counts,
                    telemetry=telemetry,
                    wiring=wiring,
                )
                lines.finish(report.memcached)
        if cluster is not None:
            report.writes_applied = sum(cluster.applied.values())
            report.writes_succeeded = writes_ok
            report.duplicate_writes = cluster.duplicate_writes()
    report.elapsed_s = time.perf_counter() - started
    return report
