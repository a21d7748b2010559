"""The manual as MkDocs builds it (``mkdocs.yml``, ``docs/``): the API reference renders every Sphinx role of
the docstrings as a cross-reference (``docs/hooks/sphinx_roles.py``) and shows no internal parameter, and a
role the build cannot render fails it. Skipped without the ``docs`` extra."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings")
griffe = pytest.importorskip("griffe")

ROOT = Path(__file__).resolve().parents[2]
#: A Sphinx role as the site would show it raw (``:class:`` before a code span or a backtick).
RAW_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj):(?:<code>|`)")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built as the CI builds it (strict, quiet) into a folder of its own."""
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)], cwd=ROOT,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_no_page_shows_a_raw_sphinx_role(site):
    raw = {str(p.relative_to(site)): RAW_ROLE.findall(p.read_text()) for p in site.rglob("*.html")}
    raw = {page: roles for page, roles in raw.items() if roles}
    assert not raw, raw


def test_roles_became_links(site):
    """Roles that name an object the reference documents are links to it (``Communicator.plan``'s
    ``tpcomm.dispatch.Plan``, for one)."""
    html = (site / "reference" / "index.html").read_text()
    links = re.findall(r'<a class="autorefs autorefs-internal"[^>]*href="[^"]*"[^>]*><code>Plan</code></a>', html)
    assert links, "no link to tpcomm.dispatch.Plan in the API reference"


def test_internal_parameters_are_not_in_signatures(site):
    """The call-cache ``key`` the communicator passes its op's modules is not shown as a parameter."""
    html = (site / "reference" / "index.html").read_text()
    assert '<span class="n">key</span><span class="o">=</span>' not in html


def test_a_role_the_build_cannot_render_is_an_error(tmp_path, caplog):
    """The extension logs an error (which fails the strict build, quiet or not) for a role it cannot convert,
    and converts the others."""
    pkg = tmp_path / "rolepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""Package."""\n\n\nclass Thing:\n    """A thing; see :class:`Other`."""\n\n\n'
                                     'class Other:\n    """Broken: :class:`not a name`."""\n')
    extensions = griffe.load_extensions(str(ROOT / "docs" / "hooks" / "sphinx_roles.py") + ":SphinxRoles")
    with caplog.at_level("ERROR"):
        loaded = griffe.load("rolepkg", search_paths=[str(tmp_path)], extensions=extensions)
    assert '<autoref identifier="rolepkg.Other" optional><code>Other</code></autoref>' in \
        loaded["Thing"].docstring.value
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any("rolepkg.Other" in m and "cannot render" in m for m in errors), errors
