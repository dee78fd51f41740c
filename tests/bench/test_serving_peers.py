"""benchmarks/serving_peers.py's load points: the same prompts for every server at a point, other
prompts at every other point (vLLM's random dataset draws the same prompts from the same seed, so
a shared seed let later points hit the prefix cache that earlier points filled)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from serving_peers import points  # noqa: E402


def seeds(extra: list[str]) -> list[str]:
    return [extra[i + 1] for i, a in enumerate(extra) if a == "--seed"]


def test_every_point_has_a_seed_of_its_own_and_keeps_it():
    args = argparse.Namespace(concurrency=[1, 16, 32], prefix_concurrency=16, rates=[2.0, 4.0], sweep_prompts=24)
    first, again = points(args), points(args)
    assert first == again  # every server (and every round) gets the same prompts at a point
    all_seeds = [seeds(extra) for _, extra in first]
    assert all(len(s) == 1 for s in all_seeds)
    assert len({s[0] for s in all_seeds}) == len(first) == 6
    labels = [label for label, _ in first]
    assert labels == ["random c1", "random c16", "random c32", "prefix c16", "poisson 2/s", "poisson 4/s"]
