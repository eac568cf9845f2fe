"""The README's and docs/'s links and Python examples stay valid.

Every relative link in README.md and docs/*.md must name an existing file, and an anchor
(`page.md#section`) a heading or an explicit `id` of that page. Every ```python block must
compile, and every name it imports from jaxpaged must exist. No model runs here.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^[ \t]*```([^\n]*)\n(.*?)^[ \t]*```[ \t]*$", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
HTML_ID = re.compile(r"""\bid=["']([^"']+)["']""")


def _prose(text: str) -> str:
    """`text` without fenced code blocks and inline code spans, where links are not links."""
    text = FENCE.sub("", text)
    return re.sub(r"`[^`\n]*`", "", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    """The anchors a link may name in `page`: its headings' slugs (numbered when repeated, as
    GitHub numbers them) and its HTML `id` attributes."""
    text = page.read_text(encoding="utf-8")
    anchors: set[str] = set()
    counts: dict[str, int] = {}
    for heading in HEADING.findall(FENCE.sub("", text)):
        slug = _slug(heading)
        n = counts.get(slug, 0)
        counts[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    anchors.update(HTML_ID.findall(text))
    return anchors


def _links():
    for page in PAGES:
        for target in LINK.findall(_prose(page.read_text(encoding="utf-8"))):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            yield pytest.param(page, target, id=f"{page.relative_to(ROOT)}->{target}")


def _python_blocks():
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            if match.group(1).strip() != "python":
                continue
            line = text.count("\n", 0, match.start()) + 2
            name = f"{page.relative_to(ROOT)}:{line}"
            # Blocks nested in a list item are indented as a whole.
            lines = match.group(2).split("\n")
            indent = min((len(l) - len(l.lstrip()) for l in lines if l.strip()), default=0)
            source = "\n".join(l[indent:] for l in lines)
            yield pytest.param(name, source, id=name)


@pytest.mark.parametrize("page,target", list(_links()))
def test_relative_link_resolves(page: Path, target: str):
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    assert dest.exists(), f"{page.relative_to(ROOT)} links to {target}: no such file"
    if anchor and dest.suffix == ".md":
        assert anchor in _anchors(dest), (
            f"{page.relative_to(ROOT)} links to {target}: {dest.name} has no anchor {anchor!r}")


@pytest.mark.parametrize("name,source", list(_python_blocks()))
def test_python_example_compiles_and_imports_exist(name: str, source: str):
    tree = compile(source, name, "exec", ast.PyCF_ONLY_AST)
    compile(tree, name, "exec")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "jaxpaged":
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), (
                    f"{name}: `from {node.module} import {alias.name}`: no such name")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "jaxpaged":
                    importlib.import_module(alias.name)


def test_every_docs_page_is_in_the_index():
    index = ROOT / "docs" / "README.md"
    linked = {(index.parent / t.partition("#")[0]).resolve()
              for t in LINK.findall(_prose(index.read_text(encoding="utf-8")))}
    unlisted = [p.name for p in PAGES[1:] if p != index and p.resolve() not in linked]
    assert not unlisted, f"docs/README.md does not list {unlisted}"


def test_blocks_and_links_are_found():
    # The checks above pass vacuously if the patterns stop matching.
    assert len(list(_python_blocks())) >= 5
    assert len(list(_links())) >= 20
