"""Target model families, weight loaders, the model registry and trained draft heads.

Installed as ``jspec.models`` (see pyproject.toml), so it never shadows another
project's top-level ``models`` package.
"""
