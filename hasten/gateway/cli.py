"""``hasten gateway --config gateway.yaml``: run the gateway."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
from dataclasses import replace

from hasten.gateway.config import ConfigError, load_config, parse_hostport


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hasten gateway",
                                description="One OpenAI-compatible endpoint in front of many replicas.")
    p.add_argument("--config", "-c", required=True, help="path to gateway.yaml")
    p.add_argument("--listen", help="override 'listen' (host:port; port 0 picks a free port)")
    p.add_argument("--http2", action="store_true", help="serve HTTP/1.1 + cleartext HTTP/2 via hypercorn")
    p.add_argument("--check", action="store_true", help="validate the config and exit")
    p.add_argument("--no-uvloop", action="store_true", help="use the default asyncio event loop")
    p.add_argument("--nice", type=int, metavar="N",
                   help="override 'nice': the gateway's CPU priority, -20 (highest) .. 19")
    p.add_argument("--malloc-mmap-threshold-kb", type=int, default=128, metavar="KIB",
                   help="glibc: allocations from this size up get their own mapping, returned on free "
                        "(default 128; 0 keeps glibc's threshold, which rises after each large free)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.malloc_mmap_threshold_kb < 0:
        print("hasten gateway: --malloc-mmap-threshold-kb must be >= 0", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config)
        if args.listen:
            try:
                host, port = parse_hostport(args.listen)
            except ValueError as exc:
                raise ConfigError("--listen", [str(exc)]) from None
            cfg = replace(cfg, host=host, port=port)
    except ConfigError as exc:
        print(f"hasten gateway: {exc}", file=sys.stderr)
        return 2
    if args.http2:
        cfg = replace(cfg, http2=True)
    if args.nice is not None:
        if not -20 <= args.nice <= 19:
            print(f"hasten gateway: --nice must be between -20 and 19, got {args.nice}", file=sys.stderr)
            return 2
        cfg = replace(cfg, nice=args.nice)
    if args.check:
        backends = sum(len(p.backends) for p in cfg.models)
        print(f"config OK: {len(cfg.models)} model pool(s), {backends} backend(s), "
              f"{len(cfg.tenants)} tenant(s)")
        return 0
    fix_mmap_threshold(args.malloc_mmap_threshold_kb)
    if cfg.nice is not None:
        set_nice(cfg.nice)
    if not args.no_uvloop:
        with contextlib.suppress(ImportError):
            import uvloop

            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        asyncio.run(_run(cfg))
    except KeyboardInterrupt:
        pass
    return 0


def fix_mmap_threshold(kib: int) -> bool:
    """Pin glibc's mmap threshold at ``kib`` KiB. By default glibc raises the threshold to the size
    of each mmapped block freed (up to 32 MiB), so after the first large request body its
    successors are carved from the main heap, which fragments and never shrinks: in the soak
    (docs/benchmarks.md) 1.3 MB bodies kept the gateway's RSS 10-20 MB above its 32 MB. A pinned
    threshold keeps every large buffer in its own mapping, given back to the system when freed.
    Returns whether it was set (False off glibc)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if kib <= 0 or name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    m_mmap_threshold = -3  # <malloc.h>
    return bool(mallopt(ctypes.c_int(m_mmap_threshold), ctypes.c_int(kib * 1024)))


def set_nice(nice: int) -> bool:
    """Set this process's CPU priority. The gateway's work per request is small but on its critical
    path: on cores shared with engine or client processes, a negative value lets it run as soon as
    bytes arrive instead of waiting out another process's time slice (docs/benchmarks.md). Lowering
    the value needs CAP_SYS_NICE (or RLIMIT_NICE); without it this warns and keeps the current one."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError as exc:
        logging.getLogger("hasten.gateway").warning(
            "cannot set nice %d (%s); the gateway keeps nice %d", nice, exc.strerror or exc,
            os.getpriority(os.PRIO_PROCESS, 0))
        return False
    return True


async def _run(cfg) -> None:  # noqa: ANN001 - GatewayConfig, imported lazily
    from hasten.gateway.core import Gateway

    gateway = Gateway(cfg)
    # everything allocated so far (modules, config, pools) lives as long as the process: keep it out
    # of the cyclic collector's scans, so a collection under load walks only per-request objects
    gc.collect()
    gc.freeze()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    if cfg.http2:
        from hasten.gateway.asgi import serve_http2

        await serve_http2(gateway, cfg.host, cfg.port, stop)
    else:
        from hasten.gateway.app import serve

        await serve(gateway, cfg.host, cfg.port, stop=stop)
