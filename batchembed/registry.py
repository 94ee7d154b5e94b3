"""Formats by name, imported when first asked for, with an install hint when their library is
missing (as fsspec's registry does). inputs/ and output/ each keep a table of theirs."""

from __future__ import annotations

import importlib

from .errors import JobError


def load(formats: dict[str, tuple[str, str, str | None]], name: str, key: str):
    """An instance of format `name` from `formats` (name -> (module, class, install hint));
    JobError naming the job key when it is unknown or its library is not installed."""
    if name not in formats:
        raise JobError(f"{key}: {name!r} is not one of {', '.join(sorted(formats))}")
    module, cls, hint = formats[name]
    try:
        return getattr(importlib.import_module(module), cls)()
    except ImportError as e:
        raise JobError(f"{key}: {name} needs {e.name}: {hint or f'pip install {e.name}'}") from None
