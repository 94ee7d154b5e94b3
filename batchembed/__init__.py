"""batchembed: embed large Parquet corpora in batch with vLLM's pooling engine."""

__version__ = "0.1.0"
