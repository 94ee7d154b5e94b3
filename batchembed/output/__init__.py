"""Output formats by name (`output.format`), imported when first asked for.

A new format is one module implementing base.OutputFormat and one line here: its module,
its class, and what to install when its library is missing (as fsspec's registry does).
The layout (layout.py) is the same for every format; each format says where its parts live.
"""

from __future__ import annotations

from ..registry import load

FORMATS: dict[str, tuple[str, str, str | None]] = {
    # name: (module, class, install hint when the module's dependency is missing)
    "parquet": ("batchembed.output.parquet", "ParquetOutput", None),
    "lance": ("batchembed.output.lance", "LanceOutput", "pip install 'batchembed[lance]' (pylance)"),
}


def get_format(name: str):
    """An instance of the named output format."""
    return load(FORMATS, name, "output.format")
