"""`hasten bench`: a load generator for any OpenAI-compatible streaming server.

Modules:
    httpclient   low-overhead asyncio HTTP/1.1 streaming client (timestamps reads, parses later)
    sse          turns timestamped body bytes into timed content chunks
    datasets     random, shared-prefix, multi-turn and ShareGPT workloads
    runner       closed/open-loop load shapes, warm-up, time/count bounds
    campaign     load points, sweeps and interleaved multi-target comparisons
    metrics      TTFT, TPOT, ITL, E2E, throughput and goodput (vllm bench serve definitions)
    report       terminal tables, JSON/CSV files and the self-contained HTML report
    fake_server  OpenAI-compatible SSE server with known timings, for tests and overhead checks
    rawclient    minimal raw-socket reference client used to measure our own overhead

This package must never import torch.
"""
