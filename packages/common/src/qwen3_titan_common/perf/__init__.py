"""One throughput convention for every backend: FLOPs per token, peak table, MFU, memory."""
