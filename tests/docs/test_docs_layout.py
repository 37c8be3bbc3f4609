"""Proves the site's first page (Getting started) and its configuration reference read at
laptop width, 1280 px (issue #36: the reference's six-column table was cut off there and
its names wrapped letter by letter).

How: the built HTML is checked against Material's layout at that width. A table fits when
its columns, each as wide as its widest word or code span plus the cells' padding, fit the
content column (a wider one scrolls sideways, cutting its last columns off, or breaks names
mid-word); a code block fits when its longest line fits without scrolling. The widths are
Material 9's own CSS (tables .64rem text with 16 px padding a side, code .85em) at 20 px to
the rem, with Chromium 156's measure of the content column at 1280 px (688 px; a code
block's text 656 px) and of characters (monospace 0.6 em, text at most 0.6 em on average).

Why not screenshots in the tests: a headless browser does not come from the package index
tests/run.sh installs from (Playwright's `install` step downloads its own browser build, and
the distribution's browser needs root and apt), so a fresh machine's run could not take them.
Screenshots taken by hand with Debian's Chromium agree with this check: the old reference's
table laid out 759 px wide in a 688 px column with its names broken letter by letter, and
this check puts it at 1,759 px unbroken; a benchmarks table Chromium scrolls by 14 px, this
check finds 22 px too wide.

Not proven: how the pages look (fonts, colours), or any page but these two.
"""

from __future__ import annotations

from html.parser import HTMLParser

import pytest
from docs_builders import BuiltSite

#: Material's content column at a 1280 px window (both sidebars shown), in CSS pixels.
CONTENT_PX = 688
#: A code block's text area: the column less 1.1765 em (16 px) of padding on each side.
CODE_BLOCK_PX = CONTENT_PX - 2 * 16
#: Monospace characters in code blocks: .85 em of 16 px, 0.6 em wide.
CODE_BLOCK_CHAR_PX = 16 * 0.85 * 0.6
#: Table text: .64 rem (12.8 px); code in a cell .85 em of that; 0.6 em a character.
TABLE_TEXT_CHAR_PX = 12.8 * 0.6
TABLE_CODE_CHAR_PX = 12.8 * 0.85 * 0.6
#: Each cell's padding (1.25 em of 12.8 px a side) and a code span's (0.29 em a side); a
#: heading cell is at least 5 rem wide, padding included (Material's boxes are border-box).
CELL_PADDING_PX = 2 * 16
HEADING_CELL_MIN_PX = 5 * 20
CODE_PADDING_PX = 2 * 0.2941 * 12.8 * 0.85
PAGES = ("index.html", "operating/configuration/index.html")


class _Content(HTMLParser):
    """The tables (rows of cells, each cell's unbreakable pieces in px) and code blocks
    (their lines) of a page's article."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[list[list[float]]] = []
        self.code_blocks: list[list[str]] = []
        self._in_article = 0
        self._in_code = 0
        self._in_pre = False
        self._cell: list[float] | None = None
        self._cell_min = 0.0
        self._text = ""
        self._pre = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        classes = (dict(attrs).get("class") or "").split()
        if tag == "article" and "md-content__inner" in classes:
            self._in_article += 1
        if not self._in_article:
            return
        if tag == "table":
            self.tables.append([])
        elif tag == "tr" and self.tables:
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell, self._text = [], ""
            self._cell_min = HEADING_CELL_MIN_PX if tag == "th" else 0.0
        elif tag == "pre":
            self._in_pre, self._pre = True, ""
        elif tag == "code" and not self._in_pre:
            self._flush(code=False)
            self._in_code += 1

    def handle_endtag(self, tag: str) -> None:
        if not self._in_article:
            return
        if tag == "code" and self._in_code:
            self._flush(code=True)
            self._in_code -= 1
        elif tag in ("td", "th") and self._cell is not None:
            self._flush(code=False)
            width = max(self._cell, default=0.0) + CELL_PADDING_PX
            self.tables[-1][-1].append(max(width, self._cell_min))
            self._cell = None
        elif tag == "pre":
            self._in_pre = False
            self.code_blocks.append(self._pre.rstrip("\n").splitlines())
        elif tag == "article":
            self._in_article -= 1

    def handle_data(self, data: str) -> None:
        if self._in_pre:
            self._pre += data
        elif self._cell is not None:
            self._text += data

    def _flush(self, *, code: bool) -> None:
        """End a run of cell text: its widest piece that no line may break (a code span
        breaks at spaces only, prose at spaces and after hyphens)."""
        if self._cell is None:
            return
        if code:
            widths = [len(word) * TABLE_CODE_CHAR_PX + CODE_PADDING_PX
                      for word in self._text.split()]
        else:
            words = self._text.replace("-", "- ").split()
            widths = [len(word) * TABLE_TEXT_CHAR_PX for word in words]
        self._cell.extend(widths)
        self._text = ""


def content_of(html: str) -> _Content:
    parser = _Content()
    parser.feed(html)
    parser.close()
    return parser


def layout_problems(html: str) -> list[str]:
    """What would not fit the content column at 1280 px: tables wider than it even with every
    column at its narrowest unbroken width, code blocks with a line wider than their text
    area."""
    content = content_of(html)
    problems = []
    for number, rows in enumerate(content.tables, 1):
        columns = max((len(row) for row in rows), default=0)
        widths = [max((row[i] for row in rows if i < len(row)), default=0.0)
                  for i in range(columns)]
        if sum(widths) > CONTENT_PX:
            problems.append(f"table {number} ({columns} columns) needs {sum(widths):.0f} px "
                            f"of {CONTENT_PX} px: its last columns are cut off, or names "
                            "break mid-word")
    for number, lines in enumerate(content.code_blocks, 1):
        longest = max(lines, key=len, default="")
        if len(longest) * CODE_BLOCK_CHAR_PX > CODE_BLOCK_PX:
            problems.append(f"code block {number}: {len(longest)} characters scroll past "
                            f"{CODE_BLOCK_PX} px: {longest!r}")
    return problems


@pytest.mark.parametrize("page", PAGES)
def test_the_page_reads_at_1280_px(built_site: BuiltSite, page: str) -> None:
    assert layout_problems(built_site.page(page)) == []


def test_the_configuration_reference_is_no_table(built_site: BuiltSite) -> None:
    content = content_of(built_site.page("operating/configuration/index.html"))
    assert content.tables == []
    assert "prefill_allowlist" in built_site.page("operating/configuration/index.html")


def _article(body: str) -> str:
    return f'<article class="md-content__inner md-typeset">{body}</article>'


def test_a_six_column_reference_table_is_seen_as_cut_off() -> None:
    row = ("<tr><td><code>prefill_data_parallel_size</code></td>"
           "<td><code>--prefill-data-parallel-size</code></td>"
           "<td><code>DISAGG_PREFILL_DATA_PARALLEL_SIZE</code></td>"
           "<td>label <code>model.aibrix.ai/prefill-data-parallel-size</code></td>"
           "<td><code>1</code></td><td>The prefill engines' data-parallel size.</td></tr>")
    (problem,) = layout_problems(_article(f"<table>{row}</table>"))
    assert "table 1 (6 columns)" in problem and "cut off" in problem


def test_a_two_column_table_of_words_fits() -> None:
    row = "<tr><td><code>--engine</code></td><td>The local engine: vllm, sglang.</td></tr>"
    assert layout_problems(_article(f"<table>{row}</table>")) == []


def test_a_code_line_past_the_width_is_seen_and_one_within_is_not() -> None:
    long_line, short_line = "x" * 81, "x" * 80
    (problem,) = layout_problems(_article(f"<pre><code>{long_line}\n{short_line}</code></pre>"))
    assert "81 characters" in problem
    assert layout_problems(_article(f"<pre><code>{short_line}</code></pre>")) == []


def test_only_the_article_counts() -> None:
    wide = "<pre><code>" + "x" * 200 + "</code></pre>"
    assert layout_problems(f"<nav>{wide}</nav>{_article('<p>text</p>')}") == []
