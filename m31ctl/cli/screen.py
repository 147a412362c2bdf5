"""What fits the screen (issue 51): one layout for tables, paragraphs and command lines, from 80
columns up.

The unit of layout is a phrase: what must stay on one line to be read or copied. A word (a setting
name, a `file:line`, a path, a URL, a date), a command in backticks, a short parenthesised command
such as `(systemctl start docker)`, and an option with its value (`--set key=value`) are each one
phrase; lines break only between phrases.

- A table that fits the width is drawn by rich as before. One that does not has its cells folded
  between phrases, each column at least as wide as its widest phrase (and a name column as its
  widest cell); where even that is too wide, it becomes a stack of records, one block each.
- A paragraph wraps between phrases, its continuation lines indented.
- A command line wider than the screen breaks between arguments, each line but the last ending in
  a backslash: it still pastes as one command.

The width is the terminal's ($COLUMNS first, as rich and shutil read it). Output to a pipe or a
file with COLUMNS unset is laid out as it always was (rich's tables and wrapping, a command on one
line): what a machine reader or a log got before, it still gets."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable, Sequence
from typing import Any

# A ruled rich table (output.table) spends three columns a cell ("│ ", " ") and one to close.
_RULES_PER_COLUMN = 3
# A parenthesised group of a few words, with no clause break in it, is one phrase: a command in
# brackets ("(systemctl start docker)", "(--set runtime.hf_cache=/data/hf)"); a longer one is prose.
_GROUP_WORDS = 3
_CLAUSE_BREAK = re.compile(r"[,;]\s")
_OPTION = re.compile(r"--?[A-Za-z][\w.-]*$")
# What an option's value looks like, unlike the English word after `--hardware` in "pass
# --hardware to plan": it has a digit, a capital (FILE, N), or one of = . / :.
_OPTION_VALUE = re.compile(r"[=./:0-9A-Z]")
# A figure, and a one-word note in brackets that belongs to it.
_NUMBER = re.compile(r"[-+]?[\d.,]+(e[-+]?\d+)?%?$")
_NOTE = re.compile(r"\([^()\s]+\)[,;]?$")
# A column this few characters short of its widest cell is given them before the others share.
_FEW = 8
# Narrower than this, wrapping helps no one: a line is left to the terminal.
_NARROWEST = 40
_CONTINUED = "  "  # a paragraph's or a stacked field's continuation lines
_GOES_ON = " \\"  # ends a command line that goes on: the shell reads one argv
_COMMAND_CONTINUED = "    "


def width(out: Any) -> int | None:
    """The width to lay out for: the console's (the terminal's, $COLUMNS first) when stdout is a
    terminal or COLUMNS is set; None for a pipe or a file nobody sized."""
    if os.environ.get("COLUMNS", "").strip().isdigit():
        return int(out.width)
    try:
        return int(out.width) if out.file.isatty() else None
    except (AttributeError, OSError, ValueError):
        return None


def phrases(text: str) -> list[str]:
    """`text`'s phrases (see the module's docstring), in order; joined by spaces they are `text`
    with its runs of spaces made one."""
    words = text.split()
    found: list[str] = []
    start = 0
    while start < len(words):
        end = _phrase_end(words, start)
        found.append(" ".join(words[start:end]))
        start = end
    return found


def _phrase_end(words: list[str], start: int) -> int:
    word = words[start]
    if word.count("`") % 2 == 1:  # a `command` that closes in a later word
        return _closing(words, start, "`")
    if word.startswith("(") and ")" not in word:
        end = _closing(words, start, ")")
        group = " ".join(words[start:end])
        return end if end - start <= _GROUP_WORDS and not _CLAUSE_BREAK.search(group) else start + 1
    following = words[start + 1] if start + 1 < len(words) else ""
    if _NUMBER.match(word) and _NOTE.match(following):  # a figure and its change: "248.2 (-72%)"
        return start + 2
    if _OPTION.match(word) and following[:1] not in ("", "-") and _OPTION_VALUE.search(following):
        return start + 2
    return start + 1


def _closing(words: list[str], start: int, mark: str) -> int:
    for end in range(start + 1, len(words)):
        if mark in words[end]:
            return end + 1
    return start + 1  # never closed: a word like any other


def wrap(text: str, columns: int, first: str = "", indent: str = _CONTINUED) -> list[str]:
    """`text` in lines of at most `columns`, broken only between phrases: the first line begins
    with `first`, the others with `indent`. A phrase wider than a line has a line of its own."""
    return _filled(phrases(text), columns, first, indent)


def _filled(pieces: Iterable[str], columns: int, first: str, indent: str, ending: str = "") -> list[str]:
    """`pieces` laid greedily into lines of at most `columns`, one space between two on a line:
    the first line begins with `first`, the others with `indent`, and every line that goes on
    ends with `ending` (counted in its width). A piece wider than a line has a line of its own."""
    lines: list[str] = []
    line, filled = first, False  # filled: the line holds a piece, past `first` or `indent`
    for piece in pieces:
        if filled and len(line) + 1 + len(piece) + len(ending) > columns:
            lines.append(line + ending)
            line = indent + piece
        else:
            line = f"{line} {piece}" if filled else line + piece
        filled = True
    lines.append(line)
    return lines


def for_stderr(line: str) -> str:
    """A line for stderr (an error, a warning, a progress line) as a terminal shows it: wrapped
    between phrases at its width, continuation lines indented. Piped or redirected (CI logs, grep)
    it stays one line: COLUMNS is not asked, a log has no width."""
    try:
        if not sys.stderr.isatty():
            return line
        columns = os.get_terminal_size(sys.stderr.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return line
    if len(line) <= columns or columns < _NARROWEST:
        return line
    return "\n".join(wrap(line, columns))


def print_paragraph(out: Any, text: str, style: str = "") -> None:
    """A line of prose: on a sized screen wrapped between phrases, continuation lines indented (as
    an error line is); elsewhere as rich prints it."""
    from rich.text import Text  # lazy: rich is start-up cost that --json never needs

    columns = width(out)
    if columns is None or len(text) <= columns:
        out.print(Text(text, style=style))
        return
    body = text.lstrip()
    leading = text[: len(text) - len(body)]  # a line indented under another keeps its indent
    for line in wrap(body, columns, leading, leading + _CONTINUED):
        out.print(Text(line, style=style), soft_wrap=True)


def print_command(out: Any, words: Sequence[str], lead: str = "") -> None:
    """A command, each of `words` already quoted for the shell, after `lead` ("try: "): one line
    where it fits or nobody sized the output; else broken between arguments with a backslash
    ending each line but the last, an option kept with its value. A word wider than the screen
    has a line to itself."""
    from rich.text import Text  # lazy: as in print_paragraph

    columns = width(out)
    line = lead + " ".join(words)
    if columns is None or len(line) <= columns:
        out.print(Text(line), soft_wrap=True)
        return
    for part in command_lines(words, columns, lead):
        out.print(Text(part), soft_wrap=True)


def command_lines(words: Sequence[str], columns: int, lead: str = "") -> list[str]:
    """`words` as shell lines of at most `columns` where each argument fits (see print_command)."""
    # Each line that goes on ends in " \\", so a copied command is the same argv.
    arguments = _arguments(words, columns - len(_COMMAND_CONTINUED) - len(_GOES_ON))
    return _filled(arguments, columns, lead, _COMMAND_CONTINUED, _GOES_ON)


def _arguments(words: Sequence[str], widest: int) -> list[str]:
    """The command's words, an option joined to the value that follows it where the two fit in
    `widest` (a JSON value of 70 characters goes on the line after its option, whole)."""
    found: list[str] = []
    for word in words:
        option = found[-1] if found else ""
        joined = f"{option} {word}"
        if (
            option.startswith("-")
            and " " not in option
            and not word.startswith("-")
            and len(joined) <= widest
        ):
            found[-1] = joined
        else:
            found.append(word)
    return found


def print_table(
    out: Any,
    title: str | None,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    names: Sequence[int] = (0,),
    labeled_head: bool = False,
) -> None:
    """A table of `rows` (cells: str, or rich Text for a style) laid out for the screen (see the
    module's docstring). The cells of the `names` columns are never broken at all; stacked, each
    record begins with its first cell, said with its column's name where `labeled_head`."""
    from m31ctl.cli.output import table  # lazy: output imports nothing of this module's

    columns_fit = width(out)
    cells = [[_plain(cell) for cell in row] for row in rows]
    natural = _widths(columns, cells, lambda text: [text])
    if columns_fit is None or _drawn(natural) <= columns_fit:
        drawn = table(title, list(columns))
        for row in rows:
            drawn.add_row(*row)
        out.print(drawn)
        return
    narrowest = _narrowest(columns, cells, names)
    if _drawn(narrowest) > columns_fit:
        _print_stacked(out, title, columns, rows, columns_fit, labeled_head)
        return
    chosen = _shared_out(narrowest, natural, columns_fit - _drawn([0] * len(columns)))
    drawn = table(title, list(columns))
    for column, chosen_width in zip(drawn.columns, chosen, strict=True):
        column.width = chosen_width
    for row in rows:
        drawn.add_row(*(_folded(cell, w) for cell, w in zip(row, chosen, strict=True)))
    out.print(drawn)


def _plain(cell: Any) -> str:
    return str(getattr(cell, "plain", cell))


def _drawn(widths: Sequence[int]) -> int:
    """How wide a ruled table with columns of `widths` is drawn."""
    return sum(widths) + _RULES_PER_COLUMN * len(widths) + 1


def _widths(columns: Sequence[str], cells: list[list[str]], units: Any) -> list[int]:
    """Each column's widest unit (`units(text)`: the pieces a cell may not break) over its header
    and cells, a cell's lines each on their own."""
    return [
        max(
            len(unit)
            for text in [header, *(row[i] for row in cells)]
            for line in text.split("\n")
            for unit in units(line) or [""]
        )
        for i, header in enumerate(columns)
    ]


def _narrowest(columns: Sequence[str], cells: list[list[str]], names: Sequence[int]) -> list[int]:
    """The narrowest each column can be with no phrase broken (no name cell broken at all); the
    headers wrap between their words."""
    phrase_widths = _widths(columns, cells, phrases)
    whole_widths = _widths(["" for _ in columns], cells, lambda text: [text])
    headers = _widths(columns, [], str.split)
    return [max(whole_widths[i], headers[i]) if i in names else phrase_widths[i] for i in range(len(columns))]


def _shared_out(narrowest: list[int], natural: list[int], room: int) -> list[int]:
    """Column widths from their narrowest up, the `room` to spare shared out: first whole to the
    columns a few characters short of their cells (a header of two words, a figure with its
    change), the fewest first; then over the others in proportion to what each still lacks (a
    column of findings more than one of short remedies)."""
    chosen = list(narrowest)
    spare = room - sum(narrowest)
    order = sorted(range(len(chosen)), key=lambda i: natural[i] - narrowest[i])
    for i in order:
        short = natural[i] - chosen[i]
        if short <= min(spare, _FEW):
            chosen[i] += short
            spare -= short
    lacking = {i: natural[i] - chosen[i] for i in order if chosen[i] < natural[i]}
    total = sum(lacking.values())
    shares = {i: min(short, spare * short // total) for i, short in lacking.items()} if total else {}
    left = spare - sum(shares.values())
    for i in sorted(lacking, key=lambda i: lacking[i] - shares[i], reverse=True)[:left]:
        shares[i] += 1  # what rounding down left, one column each
    return [width + shares.get(i, 0) for i, width in enumerate(chosen)]


def _folded(cell: Any, columns: int) -> Any:
    """The cell in lines of at most `columns`, broken between phrases; rich Text keeps its style."""
    from rich.text import Text  # lazy: as in print_paragraph

    lines = [part for line in _plain(cell).split("\n") for part in wrap(line, columns, indent="")]
    return Text("\n".join(lines), style=getattr(cell, "style", "") or "")


def _print_stacked(
    out: Any,
    title: str | None,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    columns_fit: int,
    labeled_head: bool,
) -> None:
    """One block a row: its first cell, then each other as `column: value`, on the same line while
    it fits whole, else from a line of its own wrapped between phrases; an empty cell is left out."""
    from rich.text import Text  # lazy: as in print_paragraph

    if title:
        for part in wrap(title, columns_fit):
            out.print(Text(part, style="italic"), soft_wrap=True)
    for row in rows:
        head = _plain(row[0]).replace("\n", "; ")
        for record_line in _record(
            columns, row, columns_fit, f"{columns[0]}: {head}" if labeled_head else head
        ):
            out.print(record_line, soft_wrap=True)


def _record(columns: Sequence[str], row: Sequence[Any], columns_fit: int, head: str) -> list[Any]:
    """A stacked record's lines (see _print_stacked), as rich Text, each cell's style kept."""
    from rich.text import Text  # lazy: as in print_paragraph

    lines: list[Any] = []
    line: Any = Text(head, style="bold")  # None once a folded field has ended the line
    for header, cell in zip(columns[1:], row[1:], strict=True):
        if not _plain(cell).strip():
            continue
        field = f"{header}: {_plain(cell)}".replace("\n", "; ")
        style = getattr(cell, "style", "") or ""
        if line is not None and len(line) + 2 + len(field) <= columns_fit:
            line.append("  ").append(field, style=style)
            continue
        if line is not None:
            lines.append(line)
        parts = [Text(part, style=style) for part in wrap(field, columns_fit, "  ", 2 * _CONTINUED)]
        # A field folded over lines ends its line: the next one begins a line of its own.
        lines += parts if len(parts) > 1 else []
        line = parts[0] if len(parts) == 1 else None
    return [*lines, line] if line is not None else lines
