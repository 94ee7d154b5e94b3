# Quick start: `make demo` then `make test`. Both set up .venv first if needed.
PY := .venv/bin/python

.PHONY: setup demo test lint clean
setup:
	@scripts/setup.sh

demo: setup
	@$(PY) scripts/make_demo_corpus.py out/demo-corpus
	.venv/bin/batchembed run jobs/quickstart.yaml

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# ruff, and the layering in pyproject.toml ([tool.importlinter]): no module imports one above it
lint: setup
	.venv/bin/ruff check batchembed tests scripts jobs
	.venv/bin/lint-imports

clean:
	rm -rf out .pytest_cache
