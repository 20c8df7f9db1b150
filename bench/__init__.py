"""Benchmarks of unickpt against torch.distributed.checkpoint (DCP) and the machine's own
limits. Run ``python -m bench.run [--quick]``; see docs/PERFORMANCE.md. Not tests."""
