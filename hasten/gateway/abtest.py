"""Weighted A/B split between pools, with per-arm metrics.

A route with ``split: [{pool: smollm2-int4, weight: 0.1}]`` sends 10% of its requests to
the ``smollm2-int4`` pool and keeps the rest ("control"). With a session header the choice
is sticky (a stable hash of the session id), otherwise random.
"""

from __future__ import annotations

import hashlib
import random

from hasten.gateway.govconfig import SplitArm

CONTROL = "control"


def choose_arm(arms: tuple[SplitArm, ...], session: str | None = None, rng: random.Random | None = None) -> str:
    """The pool name of the chosen arm, or ``CONTROL``."""
    if session:
        x = int.from_bytes(hashlib.blake2b(session.encode(), digest_size=8).digest(), "big") / 2.0**64
    else:
        x = (rng or random).random()
    acc = 0.0
    for arm in arms:
        acc += arm.weight
        if x < acc:
            return arm.pool
    return CONTROL
