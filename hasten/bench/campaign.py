"""Several load points, sweeps, and interleaved comparisons of several servers.

Interleaving: each load point is split into `rounds` slices of the request list; for each
slice every target runs it in turn, the order rotating from slice to slice and point to
point. Background noise therefore lands on all targets alike, and each target gets exactly
the same requests. A target's slices are pooled into one result per point.

Each point after the first gets requests of its own (workload seed + point number, same
shared-prefix system prompts), so no point replays prompts an earlier one left in a cache.

Sweep: measure the synchronous rate (concurrency 1) and the saturation throughput (max
concurrency, infinite rate), then open-loop rates evenly spaced strictly between them. In a
comparison the in-between rates span [min sync rate, max saturation rate] over all targets,
so every target is measured at the same offered rates.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from hasten.bench.client import BenchClient, ClientOptions, Target
from hasten.bench.datasets import RequestSpec, WorkloadConfig, build_workload, warmup_workload
from hasten.bench.metrics import SLO, summarize
from hasten.bench.runner import LoadPoint, RunOptions, RunResult, run_load, warm_up
from hasten.bench.tokens import TokenCounter


@dataclass
class CampaignConfig:
    targets: list[Target]
    workload: WorkloadConfig
    points: list[LoadPoint] = field(default_factory=list)
    client: ClientOptions = field(default_factory=ClientOptions)
    run: RunOptions = field(default_factory=RunOptions)
    slo: SLO | None = None
    warmup: int = 1
    rounds: int = 1
    sweep: bool = False
    sweep_points: int = 4
    sweep_max_concurrency: int | None = None
    burstiness: float = 1.0
    # each load point gets its own requests (workload seed + point number; the shared-prefix
    # system prompts stay the same), so a server's cache never holds a later point's exact prompts
    fresh_requests_per_point: bool = True
    tokenizer: TokenCounter | None = None
    log: Callable[[str], None] = field(default=lambda msg: None, repr=False)


@dataclass
class PointResult:
    """One (target, load point) cell: pooled requests and its summary."""

    run: RunResult
    summary: dict[str, Any]

    @property
    def target(self) -> str:
        return self.run.target

    @property
    def point(self) -> LoadPoint:
        return self.run.point


def sweep_rates(sync_rate: float, saturation_rate: float, n: int) -> list[float]:
    """`n` rates evenly spaced strictly between the two measured rates (none if saturation is
    not above the synchronous rate)."""
    if n <= 0 or not (saturation_rate > sync_rate > 0):
        return []
    step = (saturation_rate - sync_rate) / (n + 1)
    return [sync_rate + step * (i + 1) for i in range(n)]


def split_rounds(specs: list[RequestSpec], rounds: int) -> list[list[RequestSpec]]:
    """Contiguous slices; dependencies pointing outside a slice are dropped (the earlier
    turn already ran in an earlier slice) and the rest re-indexed."""
    rounds = max(1, min(rounds, len(specs)))
    bounds = [round(i * len(specs) / rounds) for i in range(rounds + 1)]
    out = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        chunk = []
        for spec in specs[lo:hi]:
            dep = spec.depends_on
            chunk.append(replace(spec, depends_on=dep - lo if dep is not None and lo <= dep < hi else None))
        out.append(chunk)
    return out


def point_extra(target: Target, point: LoadPoint, cfg: CampaignConfig) -> dict[str, Any]:
    """Run identification keys written next to the metrics (vllm's names where they exist)."""
    return {"target": target.name, "base_url": target.base_url, "model_id": target.model,
            "backend": "openai-chat" if cfg.client.endpoint == "chat" else "openai",
            "endpoint_type": cfg.client.endpoint, "dataset": cfg.workload.dataset,
            "label": point.label, "max_concurrency": point.concurrency,
            "request_rate": point.request_rate if math.isfinite(point.request_rate) else "inf",
            "burstiness": point.burstiness}


class Campaign:
    """Runs load points over all targets and keeps the pooled results."""

    def __init__(self, cfg: CampaignConfig) -> None:
        if not cfg.targets:
            raise ValueError("no target")
        self.cfg = cfg
        self.clients = {t.name: BenchClient(t, cfg.client, cfg.tokenizer) for t in cfg.targets}
        self.specs = build_workload(cfg.workload, tok=cfg.tokenizer)  # the first point's requests
        self.warm_specs = warmup_workload(cfg.workload, cfg.warmup, cfg.tokenizer)
        self.results: list[PointResult] = []
        self._n_points = 0

    def point_specs(self, n: int) -> list[RequestSpec]:
        """Requests of the n-th load point (every target gets the same ones)."""
        wl = self.cfg.workload
        if n == 0 or not self.cfg.fresh_requests_per_point:
            return self.specs
        return build_workload(replace(wl, seed=wl.seed + 7919 * n, prefix_seed=wl.system_prompt_seed),
                              tok=self.cfg.tokenizer)

    async def run_point(self, point: LoadPoint) -> list[PointResult]:
        cfg = self.cfg
        targets = cfg.targets
        slices = split_rounds(self.point_specs(self._n_points), cfg.rounds)
        pooled: dict[str, RunResult] = {}
        for r, chunk in enumerate(slices):
            shift = (self._n_points + r) % len(targets)
            for target in targets[shift:] + targets[:shift]:
                client = self.clients[target.name]
                if r == 0:
                    await warm_up(client, self.warm_specs, point.concurrency)
                label = f"{target.name}: {point.label} ({r + 1}/{len(slices)})" if len(slices) > 1 \
                    else f"{target.name}: {point.label}"
                run = await run_load(client, chunk, point, replace(cfg.run, seed=cfg.run.seed + r), label)
                pooled[target.name] = pooled[target.name].merged_with(run) if target.name in pooled else run
        self._n_points += 1
        out = []
        for target in targets:
            run = pooled[target.name]
            summary = summarize(run.results, run.duration, cfg.slo, **point_extra(target, point, cfg))
            out.append(PointResult(run, summary))
            cfg.log(f"{target.name:>12} {point.label:<16} {summary['request_throughput']:8.2f} req/s  "
                    f"TTFT p50 {summary['median_ttft_ms']:8.1f} ms  TPOT p50 {summary['median_tpot_ms']:7.2f} ms"
                    f"  failed {summary['failed']}")
        self.results.extend(out)
        return out

    async def run_sweep(self) -> None:
        cfg = self.cfg
        sync = await self.run_point(LoadPoint("sync", concurrency=1))
        sat_point = LoadPoint("saturation", concurrency=cfg.sweep_max_concurrency)
        sat = await self.run_point(sat_point)
        lo = min(p.summary["request_throughput"] for p in sync)
        hi = max(p.summary["request_throughput"] for p in sat)
        rates = sweep_rates(lo, hi, cfg.sweep_points)
        if not rates:
            cfg.log(f"sweep: saturation ({hi:.3g} req/s) is not above the synchronous rate "
                    f"({lo:.3g} req/s); no in-between rates")
        for rate in rates:
            await self.run_point(LoadPoint(f"rate {rate:.3g}", concurrency=cfg.sweep_max_concurrency,
                                           request_rate=rate, burstiness=cfg.burstiness))

    async def run_all(self) -> list[PointResult]:
        try:
            for point in self.cfg.points:
                await self.run_point(point)
            if self.cfg.sweep:
                await self.run_sweep()
        finally:
            for client in self.clients.values():
                client.close()
        return self.results


async def run_campaign(cfg: CampaignConfig) -> list[PointResult]:
    return await Campaign(cfg).run_all()
