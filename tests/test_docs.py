"""Every example in README.md and docs/*.md runs, as written, and every path they name exists.

A ```python block is executed on its own (each block is self-contained: imports included), in
a fresh namespace and an empty working directory, on the CPU. A block that cannot run here
(torchrun, a GPU, a download) is preceded by ``<!-- not run: REASON -->`` and reported as
skipped with that reason; there are few of those, and the count is held below.

Paths in inline code (```fxpipe/capture/_tracing.py```, ```runtime/_checkpoint.py```,
```tests/test_families.py```) and relative links must exist in the repository, or under
``fxpipe/``: the docs describe the code by where it is, and a move that forgets them fails here.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: a fenced python block, possibly indented (inside a list item); its closing fence at the same indent
FENCE = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)
NOT_RUN = re.compile(r"<!--\s*not run:\s*(?P<reason>.+?)\s*-->\s*$")
#: at most this many blocks are skipped (torchrun scripts, a GPU-only example)
MAX_NOT_RUN = 6


def _blocks() -> Iterator[Tuple[str, str, Optional[str]]]:
    """(id, code, reason it is not run or None) for every python block of the docs."""
    for path in DOCS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            before = text[: m.start()].rstrip().rsplit("\n", 1)[-1]
            skip = NOT_RUN.search(before)
            yield (f"{path.relative_to(ROOT)}:{line}", textwrap.dedent(m.group("body")),
                   skip.group("reason") if skip else None)


BLOCKS = list(_blocks())


@pytest.mark.parametrize("code,reason", [pytest.param(c, r, id=i) for i, c, r in BLOCKS])
def test_example_runs(code: str, reason: Optional[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.chdir(tmp_path)  # examples save plans and pictures: into an empty folder
    exec(compile(code, "<docs example>", "exec"), {"__name__": "__docs__"})


def test_examples_are_found_and_few_are_skipped() -> None:
    # The extraction itself can break (a fence written differently): then nothing would run.
    assert len(BLOCKS) >= 20, [i for i, _, _ in BLOCKS]
    skipped = [(i, r) for i, _, r in BLOCKS if r is not None]
    assert len(skipped) <= MAX_NOT_RUN, skipped
    # a "not run" marker must sit right above a python block, or it would silently mark nothing
    for path in DOCS:
        text = path.read_text()
        for m in re.finditer(r"<!--\s*not run:.*?-->", text):
            after = text[m.end():].lstrip()
            assert after.startswith("```python"), f"{path.name}: {m.group(0)} is not followed by a python block"


def _inline_paths(text: str) -> List[str]:
    """Repository paths quoted in inline code: a slash, and a file suffix or a trailing slash.
    A span right after "torchgpipe's" names a file of torchgpipe's repository, not of this one."""
    found = []
    for m in re.finditer(r"(?<!`)`([^`\n]+)`(?!`)", text):
        span = m.group(1)
        if text[: m.start()].endswith("torchgpipe's "):
            continue
        for token in re.split(r"[\s,]+", span):
            token = token.strip("()[]:;")
            if "/" in token and re.fullmatch(r"[\w./-]+(\.(py|md|json|sh|txt|svg|png|toml)|/)", token) \
                    and not token.startswith(("http", "/", ".")) and "://" not in token:
                found.append(token)
    return found


def _links(text: str) -> List[str]:
    """Relative link targets (``file`` or ``file#anchor``, ``#anchor`` in the same file)."""
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r'src="([^"]+)"', text)
            if not t.startswith(("http://", "https://", "mailto:"))]


def _anchors(path: Path) -> set:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)  # no headings in code
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_paths_and_links_in_the_docs_exist() -> None:
    missing = []
    for path in DOCS:
        text = path.read_text()
        for p in _inline_paths(text):
            if not any((base / p).exists() for base in (ROOT, ROOT / "fxpipe")):
                missing.append(f"{path.name}: `{p}`")
        for link in _links(text):
            target, _, anchor = link.partition("#")
            file = path.parent / target if target else path
            if not file.exists():
                missing.append(f"{path.name}: link {link}")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                missing.append(f"{path.name}: link {link} (no such heading)")
    assert not missing, "\n".join(missing)


def test_readme_is_a_front_door() -> None:
    # issue 19: the README says what fxpipe is, how to start, and links the rest (docs/)
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, len(lines)
