"""bench.request_path's counts of a module's code and of the lines that ran, on sources whose
answer is known by hand (the profiled run itself is exercised by tests/docs/test_code_map.py)."""

from __future__ import annotations

import textwrap

from bench.request_path import PathFigures, code_lines, docstring_lines

SOURCE = textwrap.dedent('''\
    """The module's docstring,
    over two lines."""

    # a comment
    import os


    class Thing:
        """One line."""

        size = 1  # code with a comment

        def grow(self) -> int:
            """Two
            lines."""
            note = """a string that is code,
            not a docstring"""
            return len(note) + self.size


    async def run() -> None:
        "a docstring in single quotes"
        await os.fsync(0)
    ''')


def test_docstrings_are_the_first_statement_of_a_module_class_or_function() -> None:
    assert docstring_lines(SOURCE) == {1, 2, 9, 14, 15, 22}


def test_code_is_what_is_not_blank_a_comment_or_a_docstring() -> None:
    # import, class, size, def grow, note (two lines), return, async def, await
    assert code_lines(SOURCE) == 9
    assert code_lines("") == 0
    assert code_lines("# only a comment\n\n") == 0


def test_the_lines_that_ran_count_a_shared_line_once_and_only_functions_that_ran() -> None:
    figures = PathFigures(
        functions={"a.py": {"outer", "outer.<locals>.inner"}, "b.py": {"f"}},
        spans={("a.py", "outer"): (10, 20), ("a.py", "outer.<locals>.inner"): (15, 25),
               ("b.py", "f"): (1, 3), ("b.py", "never"): (5, 9)})
    assert figures.ran_lines == 16 + 3


def test_intersecting_keeps_what_both_runs_ran_with_its_lines() -> None:
    first = PathFigures({"a.py": {"f", "g"}, "b.py": {"h"}},
                        {("a.py", "f"): (1, 2), ("a.py", "g"): (4, 4), ("b.py", "h"): (1, 1)})
    second = PathFigures({"a.py": {"f"}}, {("a.py", "f"): (1, 2)})
    both = first.intersect(second)
    assert both.functions == {"a.py": {"f"}}
    assert both.ran_lines == 2
