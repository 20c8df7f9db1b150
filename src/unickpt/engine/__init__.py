"""The engine: state leaves (tensors, DTensors, Sharded, per-rank values), the verified read
(plan byte ranges, read, check checksums, hand out views), the data-file writer and the staging
buffers. Entry points, adapters and rules build on it; it builds on format, plan and storage only."""
