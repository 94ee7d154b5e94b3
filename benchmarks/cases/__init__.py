"""One module per benchmark case; each defines CASE (a harness.Case)."""
