import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread per process: tests run servers and clients side by side on 2 cores, and
# OpenMP teams that share busy cores slow small ops by 10-20x (measured). Benchmarks set their own.
os.environ.setdefault("OMP_NUM_THREADS", "1")
