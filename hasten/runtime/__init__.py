"""What differs per device: step tensors on the device, the Triton decoder glue, CUDA graphs and their buckets, memory profiling, batched sampling."""
