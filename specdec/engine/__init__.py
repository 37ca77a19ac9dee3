"""The paged-KV continuous-batching engine."""
