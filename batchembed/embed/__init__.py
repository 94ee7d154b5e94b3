"""Text to vectors: tokenising, token-budget batching, the vLLM engine, Matryoshka reduction and
the vector columns' encodings."""
