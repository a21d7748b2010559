"""The user's manual (``mkdocs.yml``'s Home, Getting started, User guide and API reference, and the README)
says what a user does and gets, in the present tense: no development-record words ("now", "not yet",
"yet"); history and internals go to the design record."""

import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
#: The nav sections of the user's path.
USER_SECTIONS = ("Home", "Getting started", "User guide", "API reference")
DIARY = re.compile(r"\bnow\b|not yet|\byet\b", re.IGNORECASE)


def user_pages() -> list[Path]:
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    pages = []
    for entry in nav:
        (title, target), = entry.items()
        if title in USER_SECTIONS:
            targets = [target] if isinstance(target, str) else [p for sub in target for p in sub.values()]
            pages += [ROOT / "docs" / t for t in targets]
    return pages + [ROOT / "README.md"]


def test_the_user_path_is_in_the_nav():
    names = {p.name for p in user_pages()}
    assert {"index.md", "getting-started.md", "api.md", "reference.md", "troubleshooting.md"} <= names, names


@pytest.mark.parametrize("page", user_pages(), ids=lambda p: p.name)
def test_user_pages_read_in_the_present_tense(page):
    hits = [f"{n}: {line.strip()}" for n, line in enumerate(page.read_text().splitlines(), 1) if DIARY.search(line)]
    assert not hits, hits
