"""What every ``sdkcore`` command writes through: :class:`Output`, :data:`WIDTH`.

Rich tables and colour when the optional ``rich`` is installed, plain text otherwise;
no colour when stdout is not a terminal or ``NO_COLOR`` is set; 100 columns at most.
Shared by the command line (:mod:`sdkcore._cli`) and its commands (``explain``,
``check-config``), which :mod:`sdkcore._cli` imports: this module imports neither.
"""

from __future__ import annotations

import importlib
import io
import os
import shutil
import sys
import textwrap
from collections.abc import Sequence
from typing import Any, TextIO

from ._install import install_hint

__all__ = ["WIDTH", "Output", "UsageError", "color_wanted", "install_hint"]

#: The widest line any command prints.
WIDTH = 100


class UsageError(Exception):
    """Bad input on the command line: printed on stderr, exit code 2."""


def color_wanted(stream: TextIO) -> bool:
    """Colour only on a terminal, and never with ``NO_COLOR`` set (https://no-color.org)."""
    if os.environ.get("NO_COLOR"):
        return False
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (ValueError, OSError):  # a closed or detached stream
        return False


def _rich() -> Any:
    """The ``rich`` package, or None when the optional ``cli`` extra is not installed."""
    try:
        return importlib.import_module("rich")
    except ImportError:
        return None


class Output:
    """Where a command writes: lines, headings and tables that fit :data:`WIDTH` columns.

    With ``rich`` installed, tables are drawn by rich (coloured only when
    :func:`color_wanted`); without it, as aligned plain text. Every piece is rendered
    to a string first and then written, so a closed pipe surfaces as one
    ``BrokenPipeError`` that :func:`main` handles.
    """

    def __init__(self, stream: TextIO | None = None, *, use_rich: bool | None = None) -> None:
        self.stream: TextIO = sys.stdout if stream is None else stream
        self.color = color_wanted(self.stream)
        width = WIDTH
        if self.color:
            width = max(40, min(WIDTH, shutil.get_terminal_size((WIDTH, 24)).columns))
        self.width = width
        encoding = (getattr(self.stream, "encoding", None) or "utf-8").lower().replace("-", "")
        #: False when the stream cannot take box-drawing characters (e.g. an ASCII locale).
        self.unicode = encoding in ("utf8", "utf16", "utf32", "utf8sig")
        self.rich = _rich() if use_rich is None or use_rich else None
        if use_rich and self.rich is None:
            raise UsageError(f"rich is not installed: {install_hint('rich')}")

    # -- plain pieces ------------------------------------------------------------------
    def write(self, text: str) -> None:
        try:
            self.stream.write(text)
        except UnicodeEncodeError:
            # A stream that cannot take every character (PYTHONIOENCODING=ascii, a C
            # locale): what it cannot encode is shown as \xe9, never a traceback.
            encoding = getattr(self.stream, "encoding", None) or "ascii"
            self.stream.write(text.encode(encoding, "backslashreplace").decode(encoding))

    def line(self, text: str = "", *, style: str | None = None) -> None:
        """One line, wrapped at the width (continuation lines indented two more spaces)."""
        if style is not None and self.rich is not None and self.color:
            self.write(self._render_rich(self._text(text, style)))
            return
        self.write(self.wrap(text) + "\n")

    def wrap(self, text: str, indent: str | None = None) -> str:
        if len(text) <= self.width:
            return text
        lead = text[: len(text) - len(text.lstrip(" "))]
        return textwrap.fill(
            text,
            self.width,
            subsequent_indent=lead + "  " if indent is None else indent,
            break_on_hyphens=False,
        )

    def heading(self, text: str) -> None:
        self.line(text, style="bold")

    # -- tables ------------------------------------------------------------------------
    def table(
        self,
        columns: Sequence[str],
        rows: Sequence[Sequence[str]],
        *,
        title: str | None = None,
        indent: int = 2,
    ) -> None:
        """A table; the last column wraps to keep every line within the width.

        Every column has a header: a blank one is a ValueError (a table the reader
        cannot label), whether rich or plain text draws it.
        """
        for i, column in enumerate(columns):
            if not column.strip():
                raise ValueError(
                    f"Output.table(columns): column {i} has a blank header; every column needs "
                    f"a label, got {list(columns)!r}"
                )
        if self.rich is not None:
            self._rich_table(columns, rows, title=title, indent=indent)
        else:
            self._plain_table(columns, rows, title=title, indent=indent)

    def _plain_table(
        self,
        columns: Sequence[str],
        rows: Sequence[Sequence[str]],
        *,
        title: str | None,
        indent: int,
    ) -> None:
        pad = " " * indent
        if title:
            self.line(pad + title)
        widths = [len(c) for c in columns]
        for row in rows:
            for i, cell in enumerate(row[:-1]):
                widths[i] = max(widths[i], len(cell))
        lead = sum(w + 2 for w in widths[:-1])
        last = max(20, self.width - indent - lead)
        lines = []

        def emit(cells: Sequence[str]) -> None:
            head = "".join(f"{c:<{w}}  " for c, w in zip(cells[:-1], widths, strict=False))
            wrapped = textwrap.wrap(cells[-1], last, break_on_hyphens=False) or [""]
            lines.append((pad + head + wrapped[0]).rstrip())
            for more in wrapped[1:]:
                lines.append((pad + " " * lead + more).rstrip())

        emit(columns)
        emit(["-" * w for w in widths[:-1]] + ["-" * min(last, max(len(columns[-1]), 8))])
        for row in rows:
            emit(row)
        self.write("\n".join(lines) + "\n")

    def _text(self, text: str, style: str | None = None) -> Any:
        return importlib.import_module("rich.text").Text(text, style=style or "")

    def _render_rich(self, renderable: Any) -> str:
        console_mod = importlib.import_module("rich.console")
        buffer = io.StringIO()
        console = console_mod.Console(
            file=buffer,
            width=self.width,
            force_terminal=self.color,
            no_color=not self.color,
            color_system="auto" if self.color else None,
            highlight=False,
            markup=False,
            emoji=False,
            soft_wrap=False,
            legacy_windows=False,
        )
        console.print(renderable)
        # rich pads cells to the column width: no trailing blanks in what we print
        return "\n".join(line.rstrip() for line in buffer.getvalue().split("\n"))

    def _rich_table(
        self,
        columns: Sequence[str],
        rows: Sequence[Sequence[str]],
        *,
        title: str | None,
        indent: int,
    ) -> None:
        box = importlib.import_module("rich.box")
        table_mod = importlib.import_module("rich.table")
        padding_mod = importlib.import_module("rich.padding")
        table = table_mod.Table(
            box=box.SIMPLE_HEAD if self.unicode else box.Box(_ASCII_SIMPLE_HEAD, ascii=True),
            title=self._text(title) if title else None,
            title_justify="left",
            show_edge=False,
            pad_edge=False,
            header_style="bold" if self.color else "",
        )
        for i, column in enumerate(columns):
            last = i == len(columns) - 1
            table.add_column(
                self._text(column),
                no_wrap=not last,
                overflow="fold",
            )
        for row in rows:
            table.add_row(*(self._text(cell) for cell in row))
        self.write(self._render_rich(padding_mod.Padding(table, (0, 0, 0, indent))))


# rich's SIMPLE_HEAD with a "-" rule, for streams that cannot encode box drawing.
_ASCII_SIMPLE_HEAD = "    \n    \n -- \n    \n    \n    \n    \n    \n"
