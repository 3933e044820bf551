"""Tensor parallelism: shard math and the prefill-to-decode KV transfer plan."""
