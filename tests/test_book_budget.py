"""The book stays small and reasons before it measures, and its chapter paths stay true.

Words are whitespace-separated tokens of a page, code and tables included (what `wc -w`
counts). No page of docs/ over 5,000 words; docs/*.md together at most 62,000.

A *measured number* is a figure in the page's prose that reports a quantity: a numeral
followed by a unit of time (ns, µs, us, ms, s, seconds, minutes), of rate (GB/s, MB/s,
Gbit/s, TB/s, FLOP/s, GFLOP/s, TFLOP/s, tokens/s), of size in binary units (KiB, MiB, GiB,
TiB), a percentage, or a ratio written with x or × ("1.9x", "2.9 ×"); and any decimal
number ("0.48", "1e-10" is not one: it is an exponent, a tolerance). Prose is what is left
of the page after removing fenced code blocks, table rows (lines starting with "|"),
headings, inline code spans and link targets: commands, printed outputs and tables are
exempt, since a table is where a number belongs. Plain integers (counts, byte totals a
formula gives to the unit, years, equation numbers) are not counted: they are what the
reasoning derives, not what a run measured. At most 3 measured numbers per 100 words of
prose on every page; run details live in benchmarks/README.md.

Every `docs/<name>.md` a file of the repository names exists, so a renumbered chapter
leaves no stale path behind (the chapters were renumbered into teaching order)."""

import re
import subprocess

import pytest

from tests.conftest import REPO

PAGES = sorted((REPO / "docs").glob("*.md"))
PER_PAGE, TOTAL, PER_100 = 5_000, 62_000, 3.0

UNIT = (r"(?:%|ns\b|µs\b|us\b|ms\b|s\b|seconds?\b|minutes?\b|GB/s|MB/s|Gbit/s|TB/s|[GTP]?FLOP/s|"
        r"tokens/s|KiB\b|MiB\b|GiB\b|TiB\b|x\b|×)")
MEASURED = re.compile(r"(?<![\w.=^/-])(?:\d[\d,]*(?:\.\d+)?\s?" + UNIT + r"|\d+\.\d+(?![\w.]))")


def words(text: str) -> int:
    return len(text.split())


def prose(text: str) -> str:
    """The page without fenced code, table rows, headings, code spans and link targets."""
    kept, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.lstrip().startswith(("|", "#")):
            continue
        line = re.sub(r"`[^`]*`", "", line)
        kept.append(re.sub(r"\]\([^)]*\)", "]", line))
    return "\n".join(kept)


def measured(text: str) -> list[str]:
    return MEASURED.findall(prose(text))


def test_the_measure_counts_what_it_says():
    text = ("It ran at 1.9 times the speed, 45 ms exposed, 12% of 3.09 MiB, 25 GB/s, 2.9x.\n"
            "```\n99 ms in a block\n```\n| 7 ms | table |\nThe 2 + 2 + 12 bytes of 1,619,712 in 2020, `5 ms`.")
    assert measured(text) == ["1.9", "45 ms", "12%", "3.09 MiB", "25 GB/s", "2.9x"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_page_is_over_the_budget_or_dense_with_measurements(page):
    text = page.read_text()
    assert words(text) <= PER_PAGE, f"{page.name}: {words(text)} words, over {PER_PAGE:,}"
    found, prose_words = measured(text), words(prose(text))
    density = 100 * len(found) / max(prose_words, 1)
    assert density <= PER_100, (f"{page.name}: {len(found)} measured numbers in {prose_words} words of prose "
                                f"({density:.2f} per 100, over {PER_100}); move run details to "
                                f"benchmarks/README.md: {found}")


def test_the_book_is_small():
    total = sum(words(p.read_text()) for p in PAGES)
    assert total <= TOTAL, f"docs/*.md: {total:,} words, over {TOTAL:,}"


DOC_PATH = re.compile(r"(?<![\w.-])docs/([A-Za-z0-9_-]+\.md)")
BARE_CHAPTER = re.compile(r"\((\d\d-[a-z0-9-]+\.md)(?:#[^)]*)?\)|\"(\d\d-[a-z0-9-]+\.md)\"")


def test_every_docs_path_named_in_the_repository_exists():
    """Code comments, tests, benchmarks, configs, the README and the pages: a path
    docs/<name>.md, a link (NN-name.md) or a quoted "NN-name.md" names a page that exists."""
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    stale = []
    for name in files:
        path = REPO / name
        if path.suffix not in {".py", ".md", ".toml", ".txt", ".cfg"} and path.name != "Makefile":
            continue
        if not path.exists():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            named = DOC_PATH.findall(line) + [a or b for a, b in BARE_CHAPTER.findall(line)]
            stale += [f"{name}:{number}: docs/{page}" for page in named if not (REPO / "docs" / page).exists()]
    assert not stale, "pages that do not exist:\n" + "\n".join(stale)


def anchors(page) -> set[str]:
    """The anchors a Markdown page's headings make, as GitHub spells them."""
    found, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#+ ", line):
            found.add(re.sub(r"[^\w\- ]", "", line.split(" ", 1)[1].strip().lower()).replace(" ", "-"))
    return found


def test_every_link_to_a_section_finds_its_heading():
    """A section moved to benchmarks/README.md or renamed in a renumbered chapter leaves no
    link pointing at a heading that is gone."""
    broken = []
    for page in PAGES + [REPO / "README.md", REPO / "benchmarks" / "README.md"]:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", page.read_text()):
            path = (page.parent / target).resolve() if target else page
            if path.suffix == ".md" and (not path.exists() or anchor not in anchors(path)):
                broken.append(f"{page.relative_to(REPO)}: {target}#{anchor}")
    assert not broken, "links to missing sections:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", [p for p in PAGES if re.match(r"(\d\d|appendix)-", p.name) and p.name[:2] != "00"],
                         ids=lambda p: p.name)
def test_every_chapter_opens_with_the_code_it_teaches(page):
    """Each chapter's first lines name the folder or file of the house it teaches."""
    opening = page.read_text().splitlines()[2]
    assert opening.startswith("*Code:*") and "`numpitron/" in opening, f"{page.name} does not open with its code"
