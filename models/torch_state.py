"""PyTorch checkpoints (``.bin``, ``.pt``) as numpy arrays, for the published heads still shipped that way."""

from __future__ import annotations

import pathlib

__all__ = ["read_torch_state"]


def read_torch_state(path: pathlib.Path) -> dict:
    """A PyTorch state dict through ``torch.load(weights_only=True)`` (no code runs), as numpy arrays."""
    try:
        import torch  # optional: only .bin/.pt files need it
    except ImportError:
        raise ValueError(
            f"{path.name} is a PyTorch checkpoint and PyTorch is not installed: `pip install jspec[reference]` "
            "(or torch), or convert it to safetensors."
        ) from None
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises assorted errors on damaged files
        raise ValueError(f"{path} is corrupt, truncated or not a plain state dict ({err}); refusing it.") from err
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a state dict; refusing it.")
    out = {}
    for k, v in state.items():
        if v.dtype == torch.bool:
            out[k] = v.numpy()
        elif v.is_floating_point():
            out[k] = v.float().numpy()
        else:
            out[k] = v.long().numpy()
    return out
