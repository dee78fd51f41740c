"""Native kernels, compiled on first use with torch.utils.cpp_extension (cached afterwards)."""
