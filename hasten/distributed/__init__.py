"""Tensor parallelism on torch.distributed (gloo on CPU, nccl on GPU): sharding, collectives, ranks."""
