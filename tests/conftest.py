import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread per process: tests run servers and clients side by side on 2 cores, and
# OpenMP teams that share busy cores slow small ops by 10-20x (measured). Benchmarks set their own.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Without a GPU the Triton kernels (hasten/kernels/triton) run in Triton's interpreter on CPU tensors; the
# switch must be set before the first kernel is defined, so it is set here, before any test imports one.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
