"""The README stays a user's page whose links work and whose figures are the committed ones.

What is checked, and why:

- README.md has at most :data:`MAX_README_LINES` lines: method and history belong in ``docs/`` and
  ``CHANGELOG.md``, not on the first page a user reads.
- Its test command is the one ``.ci/run`` runs, verbatim: what the README promises is what CI does.
- Every relative link in README.md, ``docs/*.md`` and CHANGELOG.md points at a path in the repo
  (and a ``#section`` at a heading of the file it names): moved files break links silently otherwise.
- Every path to a module, config or script that README.md or ``docs/`` quote in backticks exists:
  the docs named modules that the restructure had moved.
- In the headline table (between ``<!-- headline -->`` and ``<!-- /headline -->``) each figure is
  written as ``[figure](path)`` and its number appears in that file; every other number in a row
  appears in one of the files the row links to. A figure that no committed result holds is a claim
  nobody can check.

The checks are plain functions of text and a root folder, so that their failure on a broken link or
an unsupported figure is tested too.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_README_LINES = 250
HEADLINE_START = "<!-- headline -->"
HEADLINE_END = "<!-- /headline -->"

_LINK = re.compile(r"!?\[([^\]]*)\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_REPO_PATH = re.compile(r"^(?:p2p_diloco|configs|peers|scripts|results|tests|docs)/[\w./-]*$")
# A number as a reader sees it: an optional sign, thousands separators, decimals; not the digits of
# an identifier such as fp32 or int4.
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def _without_code_blocks(markdown: str) -> str:
    return _FENCE.sub("", markdown)


def relative_links(markdown: str) -> list[tuple[str, str]]:
    """(text, target) of every link outside fenced code that points into the repo (no scheme)."""
    links = []
    for text, target in _LINK.findall(_without_code_blocks(markdown)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # https:, mailto:, or a section of the same page
        links.append((text, target))
    return links


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    headings = re.findall(r"^#+\s+(.+?)\s*$", _without_code_blocks(path.read_text()), re.MULTILINE)
    return {github_anchor(h) for h in headings}


def broken_links(markdown: str, base: Path, root: Path) -> list[str]:
    """The relative links of ``markdown`` (a file in folder ``base``) that miss, each with why."""
    problems = []
    for _, target in relative_links(markdown):
        path_part, _, anchor = target.partition("#")
        path = (base / path_part).resolve()
        if not path.is_relative_to(root.resolve()):
            problems.append(f"{target}: outside the repository")
        elif not path.exists():
            problems.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            problems.append(f"{target}: no heading #{anchor} in {path_part}")
    return problems


def missing_quoted_paths(markdown: str, root: Path) -> list[str]:
    """Repo paths quoted in backticks (``p2p_diloco/net/clock.py``) that do not exist under ``root``."""
    quoted = [word for span in _CODE_SPAN.findall(_without_code_blocks(markdown)) for word in span.split()]
    for block in _FENCE.findall(markdown):
        quoted += block.split()
    return sorted({q for q in quoted if _REPO_PATH.match(q) and not (root / q).exists()})


def _numbers(text: str) -> list[str]:
    return _NUMBER.findall(text)


def _holds(text: str, number: str) -> bool:
    return re.search(r"(?<![\d.,])" + re.escape(number) + r"(?![\d]|[.,]\d)", text) is not None


def headline_rows(readme: str) -> list[str]:
    """The data rows of the headline table: between the markers, after the header and its rule."""
    if HEADLINE_START not in readme or HEADLINE_END not in readme:
        raise ValueError(f"README.md has no headline table between {HEADLINE_START} and {HEADLINE_END}")
    block = readme.split(HEADLINE_START, 1)[1].split(HEADLINE_END, 1)[0]
    rows = [line for line in block.splitlines() if line.startswith("|")]
    return rows[2:]


def unsupported_figures(row: str, base: Path, root: Path) -> list[str]:
    """The numbers of a headline row that the files it links to do not hold, each with where it was looked for."""
    links = relative_links(row)
    if not links:
        return [f"row links to no result file: {row[:60]}"]
    texts: dict[str, str] = {}
    problems = []
    for text, target in links:
        path = (base / target.partition("#")[0]).resolve()
        if not path.is_file() or not path.is_relative_to(root.resolve()):
            problems.append(f"{target}: not a file in the repository")
            continue
        texts[target] = path.read_text()
        problems += [f"{n} is not in {target}" for n in _numbers(text) if not _holds(texts[target], n)]
    rest = _LINK.sub("", row)
    for n in _numbers(rest):
        if texts and not any(_holds(t, n) for t in texts.values()):
            problems.append(f"{n} (outside a link) is in none of {sorted(texts)}")
    return problems


def _docs() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "CHANGELOG.md"]


def test_readme_is_a_short_page() -> None:
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES})"


def test_readme_runs_the_tests_as_ci_does() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = [line for line in ci if line.startswith("bash scripts/install.sh")]
    assert commands, ".ci/run runs no install + test command"
    readme_lines = README.read_text().splitlines()
    for command in commands:
        assert command in readme_lines, f"README.md does not show .ci/run's command verbatim: {command}"


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files(doc: Path) -> None:
    assert doc.exists(), f"{doc.relative_to(ROOT)} is missing"
    assert broken_links(doc.read_text(), doc.parent, ROOT) == []


@pytest.mark.parametrize("doc", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: str(p.relative_to(ROOT)))
def test_quoted_repo_paths_exist(doc: Path) -> None:
    assert missing_quoted_paths(doc.read_text(), ROOT) == []


def test_headline_figures_are_in_their_result_files() -> None:
    rows = headline_rows(README.read_text())
    assert rows, "the headline table has no rows"
    problems = [p for row in rows for p in unsupported_figures(row, ROOT, ROOT)]
    assert problems == []


# The checks themselves: each must fail on the defect it exists for.


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    (tmp_path / "results" / "bench").mkdir(parents=True)
    (tmp_path / "results" / "bench" / "bench.md").write_text("eval 1.4777, +9.4% on 4 learners, 6,305,792 tokens\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "usage.md").write_text("# Usage\n\n## When joining fails\n")
    return tmp_path


def test_a_broken_link_is_found(repo: Path) -> None:
    page = "[ok](results/bench/bench.md) [gone](results/bench/old.md) [web](https://example.org) [up](../x.md)"
    assert broken_links(page, repo, repo) == ["results/bench/old.md: no such file", "../x.md: outside the repository"]


def test_a_missing_section_is_found(repo: Path) -> None:
    assert broken_links("[a](docs/usage.md#when-joining-fails)", repo, repo) == []
    assert broken_links("[a](docs/usage.md#threat-model)", repo, repo) == [
        "docs/usage.md#threat-model: no heading #threat-model in docs/usage.md"]


def test_links_in_code_blocks_are_not_links(repo: Path) -> None:
    assert broken_links("```\n[x](nowhere.md)\n```\n", repo, repo) == []


def test_a_quoted_path_that_moved_is_found(repo: Path) -> None:
    page = ("see `p2p_diloco/swarm.py` and `docs/usage.md`, run `p2p-diloco swarm` or `python scripts/y.py --fast`\n"
            "```bash\npython scripts/x.py\n```")
    assert missing_quoted_paths(page, repo) == ["p2p_diloco/swarm.py", "scripts/x.py", "scripts/y.py"]


def test_a_figure_not_in_its_file_is_found(repo: Path) -> None:
    good = "| main | 4 learners | eval [1.4777](results/bench/bench.md) ([+9.4%](results/bench/bench.md)) |"
    assert unsupported_figures(good, repo, repo) == []
    assert unsupported_figures(good.replace("1.4777", "1.477"), repo, repo) == ["1.477 is not in results/bench/bench.md"]
    assert unsupported_figures(good.replace("+9.4%", "-9.4%"), repo, repo) == ["-9.4 is not in results/bench/bench.md"]
    assert unsupported_figures(good.replace("4 learners", "8 learners"), repo, repo) == [
        "8 (outside a link) is in none of ['results/bench/bench.md']"]
    assert unsupported_figures("| main | eval 1.4777 |", repo, repo) == ["row links to no result file: | main | eval 1.4777 |"]
    assert unsupported_figures("| a | [6,305,792](results/bench/bench.md) tokens |", repo, repo) == []


def test_the_headline_table_must_be_marked() -> None:
    with pytest.raises(ValueError, match="no headline table"):
        headline_rows("| a | b |\n|---|---|\n| c | [1](x.md) |\n")
