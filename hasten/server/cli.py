"""`hasten serve [MODEL] [--host --port ...]`: run the OpenAI-compatible server.

The HTTP listener comes up at once (so `/health` can answer 503 while loading); the
engine loads in the background and the log says when it is ready and how long
start-up took. SIGTERM/SIGINT stop accepting connections, let in-flight requests
(streams included) finish for up to --graceful-timeout seconds, then shut the engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from hasten.config import parse_option_pairs, switches_as_bools
from hasten.server.auth import API_KEY_ENV
from hasten.server.grammar_limits import StructuredLimits
from hasten.server.limits import HTTPLimits
from hasten.server.tool_parsers import PARSERS

logger = logging.getLogger("hasten.server")

EMBED_FACTORY = "hasten.server.embeddings:EmbedEngine.from_options"
ENGINE_MODES = {
    "process": "hasten.server.engine_process:ProcessEngine.from_options",
    "thread": "hasten.engine.async_engine:AsyncLLM.from_options",
}

# flag -> engine option name; only flags given on the command line are passed on.
ENGINE_FLAGS = {
    "dtype": "dtype",
    "max_model_len": "max_model_len",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "max_waiting_requests": "max_waiting_requests",
    "kv_cache_memory_gb": "kv_cache_memory_gb",
    "kv_cache_dtype": "kv_cache_dtype",
    "num_kv_blocks": "num_kv_blocks",
    "scheduling_policy": "scheduling_policy",
    "num_threads": "num_threads",
    "speculative": "speculative",
    "num_speculative_tokens": "num_speculative_tokens",
    "speculative_adaptive": "speculative_adaptive",
    "quantization": "quantization",
    "attention_backend": "attention_backend",
    "device": "device",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "enforce_eager": "enforce_eager",
    "enable_prefix_caching": "enable_prefix_caching",
    "enable_chunked_prefill": "enable_chunked_prefill",
    "tensor_parallel_size": "tensor_parallel_size",
    "pipeline_parallel_size": "pipeline_parallel_size",
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hasten serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="HF model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients may use in `model`; the first is reported")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--max-waiting-requests", type=int, help="queue limit; beyond it requests get 429")
    p.add_argument("--kv-cache-memory-gb", type=float)
    p.add_argument("--kv-cache-dtype", choices=["auto", "float32", "float16", "bfloat16", "int8"],
                   help="KV cache element type (default auto = the model dtype; float16 halves its bytes, int8 on "
                        "the CPU takes ~0.27x float32's: each head's row with its own scale)")
    p.add_argument("--num-kv-blocks", type=int)
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"])
    p.add_argument("--num-threads", type=int)
    p.add_argument("--speculative", help="speculative decoding: ngram | draft:<model path> | eagle:<folder from hasten distill draft> "
                        "| ngram+eagle:<folder> (prompt lookup after a match of 2+ tokens, the head elsewhere)")
    p.add_argument("--num-speculative-tokens", type=int, help="most draft tokens verified per step")
    p.add_argument("--speculative-adaptive", action=argparse.BooleanOptionalAction, default=None,
                   help="choose the depth per step from acceptance rates (default on)")
    p.add_argument("--quantization", choices=["int8", "int4", "gguf"], help="weight-only quantization")
    p.add_argument("--attention-backend", choices=["auto", "cpp", "sdpa", "triton"],
                   help="cpp: C++ kernel reading the paged KV cache in place; sdpa: gather + SDPA; triton: the GPU "
                        "kernels (default auto: cpp on the CPU, triton on CUDA)")
    p.add_argument("--device", help="cpu (default) | cuda | cuda:N: where weights, KV cache and steps live")
    p.add_argument("--gpu-memory-utilization", type=float,
                   help="CUDA: share of the device memory for weights, activations and KV cache (default 0.9)")
    p.add_argument("--enforce-eager", action="store_true", default=None,
                   help="CUDA: no CUDA graphs for decode steps")
    p.add_argument("--tensor-parallel-size", "-tp", type=int,
                   help="split the model over N ranks (torch.distributed; one node spawns them; several nodes: "
                        "torchrun-style MASTER_ADDR / MASTER_PORT / WORLD_SIZE / RANK, docs/deploy.md)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int,
                   help="split the model's layers into N pipeline stages, one rank each (launched as for -tp)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--engine-option", "-O", action="append", default=[], metavar="KEY=VALUE",
                   help="any other engine option (value parsed as a Python literal if possible)")
    p.add_argument("--engine-mode", choices=list(ENGINE_MODES), default="process",
                   help="where the engine loop runs: a child process (default: HTTP work and the GIL never "
                        "delay a step) or a thread of the server process (see docs/server.md)")
    p.add_argument("--engine-factory", default=None,
                   help="MODULE:CALLABLE(model, **options) building the engine; overrides --engine-mode "
                        "(for tests and experiments)")
    sup = p.add_argument_group("engine supervision (docs/server.md)")
    sup.add_argument("--max-engine-restarts", type=int, default=5,
                     help="automatic restarts of a failed engine allowed within --engine-restart-window; "
                          "one more failure and the server exits with status 1 (default 5)")
    sup.add_argument("--engine-restart-window", type=float, default=300.0, metavar="SECONDS",
                     help="window for --max-engine-restarts (default 300)")
    sup.add_argument("--engine-watchdog-timeout", type=float, default=60.0, metavar="SECONDS",
                     help="requests in flight and no engine step for this long: /health answers 503 (default 60)")
    lim = p.add_argument_group("HTTP limits (docs/server.md)")
    lim.add_argument("--max-request-bytes", type=int, default=HTTPLimits.max_request_bytes, metavar="BYTES",
                     help="largest request body; a larger one gets 413 before it is read (default 8 MiB)")
    lim.add_argument("--max-header-bytes", type=int, default=HTTPLimits.max_header_bytes, metavar="BYTES",
                     help="largest request line + headers; more gets 431 (default 64 KiB)")
    lim.add_argument("--header-timeout", type=float, default=HTTPLimits.header_timeout, metavar="SECONDS",
                     help="a request head (from connection open or its first byte) must be complete "
                          "within this; else 408 and close (default 10)")
    lim.add_argument("--body-timeout", type=float, default=HTTPLimits.body_timeout, metavar="SECONDS",
                     help="a request body must have arrived in full this long after its head; else 408 and "
                          "close (default 30)")
    lim.add_argument("--timeout-keep-alive", type=float, default=HTTPLimits.timeout_keep_alive,
                     metavar="SECONDS", help="close a kept-alive connection idle for this long (default 5)")
    so = p.add_argument_group("structured output: response_format budgets (docs/server.md)")
    so.add_argument("--max-schema-bytes", type=int, default=StructuredLimits.max_schema_bytes, metavar="BYTES",
                    help="largest JSON schema (as compact JSON); more gets 400 (default 64 KiB)")
    so.add_argument("--max-schema-enum-values", type=int, default=StructuredLimits.max_enum_values, metavar="N",
                    help="most enum values in one schema; more gets 400 (default 4096)")
    so.add_argument("--max-schema-properties", type=int, default=StructuredLimits.max_properties, metavar="N",
                    help="most object properties in one schema; more gets 400 (default 512)")
    so.add_argument("--grammar-compile-timeout", type=float, default=StructuredLimits.compile_timeout_s,
                    metavar="SECONDS", help="a schema that takes longer to compile gets 400 and its compile "
                                            "process is killed (default 10)")
    so.add_argument("--grammar-cache-bytes", type=int, default=StructuredLimits.cache_bytes, metavar="BYTES",
                    help="compiled grammars kept in memory (default 256 MiB)")
    p.add_argument("--tool-call-parser", choices=list(PARSERS), default=None,
                   help="the tool-call format recognised with tool_choice auto (default: the one the chat "
                        "template uses; hermes for a template without tool syntax)")
    p.add_argument("--task", choices=["generate", "embed"], default="generate",
                   help="embed: serve a sentence-embedding model on /v1/embeddings (default MODEL: the "
                        "packaged all-MiniLM-L6-v2; see docs/server.md)")
    p.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template file that replaces the tokenizer's")
    auth = p.add_argument_group("authentication (docs/server.md)")
    auth.add_argument("--api-key", default=None,
                      help="require this key on /v1/* (Authorization: Bearer KEY or x-api-key: KEY); "
                           f"default: the {API_KEY_ENV} environment variable, if set")
    auth.add_argument("--protect-metrics", action="store_true", help="require the API key on /metrics too")
    p.add_argument("--graceful-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    p.add_argument("--log-level", default="info")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn access log)")
    return p.parse_args(argv)


def http_limits(args: argparse.Namespace) -> HTTPLimits:
    try:
        return HTTPLimits(max_request_bytes=args.max_request_bytes, max_header_bytes=args.max_header_bytes,
                          header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                          timeout_keep_alive=args.timeout_keep_alive)
    except ValueError as exc:
        raise SystemExit(f"hasten serve: {exc}") from None


def structured_limits(args: argparse.Namespace) -> StructuredLimits:
    try:
        return StructuredLimits(max_schema_bytes=args.max_schema_bytes, max_enum_values=args.max_schema_enum_values,
                                max_properties=args.max_schema_properties,
                                compile_timeout_s=args.grammar_compile_timeout,
                                cache_bytes=args.grammar_cache_bytes, prestart=True)
    except ValueError as exc:
        raise SystemExit(f"hasten serve: {exc}") from None


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for flag, name in ENGINE_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            options[name] = value
    try:
        return options | parse_option_pairs(args.engine_option)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def check_engine_options(options: dict[str, Any], task: str) -> None:
    """Exit 2, before anything listens, on an option the engine does not know."""
    if task == "embed":
        from hasten.server.embeddings import EMBED_OPTIONS

        known = set(EMBED_OPTIONS)
    else:
        from hasten.config import EngineConfig

        known = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
    unknown = sorted(set(options) - known)
    if unknown:
        print(f"hasten serve: unknown engine option(s) {', '.join(unknown)}"
              f"{' for --task embed' if task == 'embed' else ''}; valid options: {', '.join(sorted(known))}",
              file=sys.stderr)
        raise SystemExit(2)


def _usage_error(message: str) -> SystemExit:
    print(f"hasten serve: {message}", file=sys.stderr)
    return SystemExit(2)


def read_chat_template(path: str | None) -> str | None:
    """The template file's text, checked to be valid Jinja (exit 2 otherwise)."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        import jinja2

        jinja2.Environment().parse(text)
    except (OSError, UnicodeDecodeError) as exc:
        raise _usage_error(f"cannot read --chat-template {path}: {exc}") from None
    except jinja2.TemplateSyntaxError as exc:
        raise _usage_error(f"--chat-template {path} is not a valid Jinja template: {exc.message} "
                           f"(line {exc.lineno})") from None
    return text


def api_key(args: argparse.Namespace) -> str | None:
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if args.api_key == "":
        raise _usage_error("--api-key must not be empty")
    if args.protect_metrics and not key:
        raise _usage_error(f"--protect-metrics needs --api-key (or {API_KEY_ENV})")
    return key


def load_callable(spec: str) -> Callable[..., Any]:
    module_name, _, attr = spec.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _fast_loop_and_http() -> tuple[str, str]:
    loop, http = "asyncio", "h11"
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        pass
    try:
        import httptools  # noqa: F401

        http = "httptools"
    except ImportError:
        pass
    return loop, http


def uvicorn_limits(limits: HTTPLimits, http: str) -> dict[str, Any]:
    """uvicorn settings for `limits`; with httptools, a protocol that adds the header/body timeouts and
    the head-size limit (hasten/server/http_protocol.py)."""
    options: dict[str, Any] = {"http": http, "timeout_keep_alive": limits.timeout_keep_alive,
                               "h11_max_incomplete_event_size": limits.max_header_bytes}
    if http == "httptools":
        from hasten.server.http_protocol import protocol_class

        options["http"] = protocol_class(limits)
    else:
        logger.warning("httptools is not installed: no header or body timeouts (--header-timeout, "
                       "--body-timeout)")
    return options


def _serve_as_worker_rank(options: dict[str, Any]) -> bool:
    """On a rank > 0 of a torchrun-style launch there is no server: run this rank's part of the engine."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or int(os.environ.get("RANK", "0")) == 0:
        return False
    from hasten.distributed.group import external_launch
    from hasten.distributed.worker import worker_main

    launch = external_launch()
    tp = options.get("tensor_parallel_size", 1)
    world = tp * options.get("pipeline_parallel_size", 1)
    if launch is None or world != launch["world"]:
        raise _usage_error(f"WORLD_SIZE={os.environ.get('WORLD_SIZE')} needs --tensor-parallel-size or "
                           f"--pipeline-parallel-size (their product) {os.environ.get('WORLD_SIZE')} on every rank")
    logger.info("parallel rank %d of %d: joining %s", launch["rank"], world, launch["init_method"])
    worker_main(launch["rank"], world, launch["init_method"], float(options.get("distributed_timeout_s", 300.0)), tp)
    return True


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from hasten.server.app import build_app
    from hasten.server.tracing import configure_logging

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    configure_logging(args.log_level)
    options = engine_options(args)
    if args.engine_factory is None:
        check_engine_options(options, args.task)
    try:  # "false" must not switch a feature on by being a non-empty string
        options = switches_as_bools(options)
    except TypeError as exc:
        raise _usage_error(str(exc)) from None
    if args.task == "embed" and args.chat_template:
        raise _usage_error("--chat-template does not apply to --task embed")
    template = read_chat_template(args.chat_template)
    if _serve_as_worker_rank(options):
        return 0
    key = api_key(args)
    spec = args.engine_factory or (EMBED_FACTORY if args.task == "embed" else ENGINE_MODES[args.engine_mode])
    factory = load_callable(spec)
    logger.info("loading %s with options %s", args.model or "the default model", options or "{}")

    def build_engine() -> Any:
        engine = factory(args.model, **options)
        if template is not None:
            engine.tokenizer.chat_template = template
        return engine

    failed: list[BaseException] = []
    servers: list[Any] = []

    def on_load_failure(exc: BaseException) -> None:
        # Called on the event loop. Not a SIGTERM to ourselves: uvicorn re-raises a signal it caught once it
        # has shut down, and the process would end with status 143 instead of 1.
        failed.append(exc)
        for server in servers:
            server.should_exit = True

    from hasten.server.supervisor import SupervisionConfig

    try:
        supervision = SupervisionConfig(max_restarts=args.max_engine_restarts,
                                        restart_window_s=args.engine_restart_window,
                                        watchdog_s=args.engine_watchdog_timeout)
    except ValueError as exc:
        raise SystemExit(f"hasten serve: {exc}") from None
    limits = http_limits(args)
    app = build_app(build_engine, args.served_model_name, on_load_failure, supervision=supervision,
                    limits=limits, structured=structured_limits(args), api_key=key,
                    protect_metrics=args.protect_metrics, tool_call_parser=args.tool_call_parser,
                    freeze_heap_after_load=options.get("gc_freeze", True))
    loop, http = _fast_loop_and_http()
    config = uvicorn.Config(app, host=args.host, port=args.port, loop=loop, log_level=args.log_level,
                            access_log=args.access_log, lifespan="on", log_config=None,
                            timeout_graceful_shutdown=args.graceful_timeout, **uvicorn_limits(limits, http))
    server = uvicorn.Server(config)
    servers.append(server)
    logger.info("listening on http://%s:%d (loop=%s, http=%s)", args.host, args.port, loop, http)
    server.run()
    if failed:
        reason = (str(failed[0]).strip().splitlines() or [type(failed[0]).__name__])[-1]
        logger.error("exiting: the engine failed: %s", reason)
        return 1
    logger.info("server stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
