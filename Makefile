# Quick start: `make demo` then `make test`. Both set up .venv first if needed.
PY := .venv/bin/python
FAST := not engine and not s3 and not slow

.PHONY: setup demo test test-fast lint docs reference clean
setup:
	@scripts/setup.sh

demo: setup
	@$(PY) -m benchmarks.corpus out/demo-corpus
	.venv/bin/batchembed run jobs/quickstart.yaml

# everything: the real engine, the S3 server, whole processes (CI's command)
test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# the unit and fake-engine tests, under a minute
test-fast: setup
	$(PY) -m pytest -m "$(FAST)" $(PYTEST_ARGS)

# ruff, and the layering in pyproject.toml ([tool.importlinter]): no module imports one above it
lint: setup
	.venv/bin/ruff check batchembed benchmarks tests jobs
	.venv/bin/lint-imports

# the docs site into out/site; strict: a broken link, an anchor or a page missing from the nav fails
docs: setup
	$(PY) -m batchembed.docgen --check
	.venv/bin/mkdocs build --strict --quiet

# regenerate docs/reference/ from the job schema and the commands
reference: setup
	$(PY) -m batchembed.docgen

clean:
	rm -rf out .pytest_cache
