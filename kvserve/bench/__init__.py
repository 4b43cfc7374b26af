"""Benchmarks that compare kvserve with the peer a user would otherwise pick, in one run."""
