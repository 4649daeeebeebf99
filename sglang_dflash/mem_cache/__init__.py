"""Paged KV memory: request-to-token table, token slot allocator, per-layer K/V buffers."""
