"""Which device a model runs on: ``cpu``, ``cuda`` or ``cuda:N``, checked before anything is allocated."""

from __future__ import annotations

import re

import torch

from kvferry.errors import ConfigError

__all__ = ["resolve_device"]


def resolve_device(name: str | torch.device, *, flag: str = "--device") -> torch.device:
    """The torch device ``name`` names, refused in one line (naming ``flag``) when torch cannot use it here.

    :raises ~kvferry.errors.ConfigError: not ``cpu`` / ``cuda`` / ``cuda:N``, CUDA where torch sees no GPU,
        or a GPU index past the last one.
    """
    text = str(name)
    match = re.fullmatch(r"(cpu|cuda)(?::(\d+))?", text)
    if match is None or (match.group(1) == "cpu" and match.group(2) is not None):
        raise ConfigError(f"{flag} {text!r}: expected cpu, cuda or cuda:N")
    if match.group(1) == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"{flag} {text}: CUDA is not available here (torch sees no GPU)")
    count = torch.cuda.device_count()
    index = int(match.group(2) or torch.cuda.current_device())
    if index >= count:
        raise ConfigError(f"{flag} {text}: torch sees {count} GPU(s) (cuda:0 to cuda:{count - 1})")
    return torch.device("cuda", index)
