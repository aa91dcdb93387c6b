"""The decoding loops: plain and speculative, batching, the adaptive fallback, meshes, compilation."""
