"""What the `hasten distill` commands share: their error exit and the checks on --out."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

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


def train_with_progress(loop: Any, out: Path, desc: str) -> Any:
    """Resume `loop` (a hasten.distill.train.TrainLoop) from out's checkpoint when there is one (a
    checkpoint of another run is an exit-2 error), then run it under a progress bar showing the loss
    and the loop's held-out figure. Returns the loop's final state."""
    from tqdm import tqdm

    try:
        if loop.try_resume():
            print(f"resumed from {out / CHECKPOINT} at step {loop.state.step}")
    except ValueError as exc:
        raise fail(str(exc)) from None
    bar = tqdm(total=loop.config.steps, initial=loop.state.step, desc=desc, file=sys.stderr)

    def progress(state, record) -> None:
        bar.update(1)
        shown = {"loss": f"{record['loss']:.4f}"}
        if loop.metric in record:
            shown[loop.metric] = f"{record[loop.metric]:.4f}"
        bar.set_postfix(shown)

    state = loop.run(progress)
    bar.close()
    return state
