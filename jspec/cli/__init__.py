"""The `jspec` command: the entry point (``main``), the decoding commands and what they share."""
