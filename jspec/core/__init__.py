"""The exact core: sampling, chain and tree verification, the KV cache."""
