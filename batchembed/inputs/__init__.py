"""Input formats by name (`input.format`), imported when first asked for.

A new format is one module implementing base.InputFormat and one line here: its module,
its class, and what to install when its library is missing (as fsspec's registry does).
"""

from __future__ import annotations

from ..registry import load

FORMATS: dict[str, tuple[str, str, str | None]] = {
    # name: (module, class, install hint when the module's dependency is missing)
    "parquet": ("batchembed.inputs.parquet", "ParquetInput", None),
}


def get_format(name: str):
    """An instance of the named input format."""
    return load(FORMATS, name, "input.format")
