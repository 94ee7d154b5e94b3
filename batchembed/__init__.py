"""batchembed: embed large Parquet corpora in batch with vLLM's pooling engine."""

__version__ = "0.8.1"

# vLLM's engine processes run this import too when spawned while an engine is built (they import
# the main module of the process that spawned them): procguard says what they do first.
from . import procguard as _procguard  # noqa: E402

_procguard.guard()
