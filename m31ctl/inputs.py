"""Reading the files a user hands to m31ctl: one place that decodes them and says what went wrong."""

from __future__ import annotations

from pathlib import Path

from m31ctl.errors import InputError


def read_text(path: Path, what: str, hint: str | None = None) -> str:
    """The UTF-8 text of `path`. Missing, unreadable and non-UTF-8 files are bad input (exit 2)
    naming the file, never a traceback."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{what} not found: {path}", hint=hint) from None
    except IsADirectoryError:
        raise InputError(f"{what} {path} is a directory, not a file", hint=hint) from None
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{what} {path} is not UTF-8 text (byte {exc.start})", hint="save it as UTF-8"
        ) from None
    except OSError as exc:
        raise InputError(f"cannot read {what} {path}: {exc.strerror}", hint=hint) from None


def read_bytes(path: Path, what: str) -> bytes:
    """The bytes of `path`, or bad input (exit 2) naming the file."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise InputError(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise InputError(f"{what} {path} is a directory, not a file") from None
    except OSError as exc:
        raise InputError(f"cannot read {what} {path}: {exc.strerror}") from None


def decode(raw: bytes, path: Path, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{what} {path} is not UTF-8 text (byte {exc.start})", hint="save it as UTF-8"
        ) from None


def read_text_if_exists(path: Path, what: str) -> str | None:
    """As read_text, but None when there is no such file (render writes and --check)."""
    if not path.exists():
        return None
    return read_text(path, what)
