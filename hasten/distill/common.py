"""What the `hasten distill` commands share: their error exit and the checks on --out."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

CHECKPOINT = "distill-checkpoint.pt"  # the training state in --out while a run is unfinished


def fail(message: str) -> SystemExit:
    """Print `message` as the command's error; raise the returned SystemExit (status 2)."""
    print(f"hasten distill: {message}", file=sys.stderr)
    return SystemExit(2)


def check_out(args: argparse.Namespace, target: Path, report: str) -> Path:
    """--out as a folder that is not the target's and holds no finished result (unless --restart);
    --max-minutes not negative."""
    out = Path(args.out).expanduser()
    if out.resolve() == target.resolve():
        raise fail("--out must not be the target's own folder")
    if out.exists() and not out.is_dir():
        raise fail(f"--out {out} is a file")
    if not args.restart and (out / report).exists() and not (out / CHECKPOINT).exists():
        raise fail(f"{out} already holds a finished result: pass --restart to redo it, or another --out")
    if args.max_minutes is not None and args.max_minutes < 0:
        raise fail("--max-minutes must not be negative")
    return out
