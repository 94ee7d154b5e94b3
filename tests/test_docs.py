"""The docs stay true to the code: the generated reference pages are current, every environment
variable the code reads is documented, and the README stays a landing page."""

from __future__ import annotations

import re
from pathlib import Path

from batchembed import docgen
from batchembed.config import JobSpec

ROOT = Path(__file__).resolve().parents[1]


def test_the_generated_reference_pages_are_current():
    """Regenerate with `python -m batchembed.docgen` after changing the schema or a command."""
    assert docgen.main(["--check"]) == 0


def test_every_job_key_is_in_the_reference_by_its_dotted_name():
    page = (ROOT / "docs" / "reference" / "job-file.md").read_text()

    def keys(model, prefix=""):
        for name, field in model.model_fields.items():
            yield prefix + name
            sub = docgen._model_of(field.annotation)
            if sub is not None:
                yield from keys(sub, f"{prefix}{name}.")

    missing = [k for k in keys(JobSpec) if f"| `{k}` |" not in page]
    assert not missing


def test_every_environment_variable_the_code_reads_is_documented():
    used = set()
    for path in [*(ROOT / "batchembed").rglob("*.py"), *(ROOT / "jobs").glob("*.py"), *(ROOT / "tests").glob("*.py")]:
        used |= set(re.findall(r"\b_?BATCHEMBED_[A-Z_]+\b", path.read_text()))
    page = (ROOT / "docs" / "environment.md").read_text()
    assert sorted(v for v in used if f"`{v}" not in page) == []


def test_the_readme_is_a_landing_page_that_links_into_the_docs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    for target in re.findall(r"\]\(((?:docs/)[^)#]+)", readme):
        assert (ROOT / target).exists(), target
