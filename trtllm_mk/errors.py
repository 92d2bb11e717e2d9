"""User-facing errors.

Anything a user can cause (a bad YAML, an unknown model, a missing or corrupt checkpoint or engine,
a wrong GPU) raises ``UserError``. Command-line entry points wrap their body in ``run_cli`` so that
such an error ends with one clear line on stderr and exit code 2, never a traceback. Programming
errors are *not* UserErrors and keep their tracebacks.
"""
from __future__ import annotations

import numbers
import sys
import warnings
from pathlib import Path
from typing import Callable


class UserError(Exception):
    """An error caused by user input; its message is the whole report (one line, names the fix)."""


class ConfigError(UserError):
    """A deployment YAML that is malformed, has unknown keys, wrong types or impossible values."""


class ModelError(UserError):
    """An unsupported architecture, or a checkpoint that is missing, misshaped or truncated."""


class EngineError(UserError):
    """An engine directory that is missing, corrupted, or built for another GPU."""


def read_json_object(path, error: type[UserError], fix: str) -> dict:
    """A JSON object read from ``path``; anything else (unreadable, not UTF-8, not JSON, not an object)
    is one ``error`` naming the file and ending with ``fix``."""
    import json
    try:
        obj = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e.msg} at line {e.lineno}); {fix}") from None
    except UnicodeDecodeError:
        raise error(f"{path}: not UTF-8 text; {fix}") from None
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror}); {fix}") from None
    if not isinstance(obj, dict):
        raise error(f"{path}: expected a JSON object; {fix}")
    return obj


def is_int(v) -> bool:
    """An integer argument (bool and floats are not; numpy integers are)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def short_repr(v) -> str:
    """``repr(v)`` cut to fit a one-line error."""
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _warning_line(message, category, filename, lineno, line=None) -> str:
    return "warning: " + " ".join(str(message).split()) + "\n"


def run_cli(main: Callable[[], int | None]) -> None:
    """Run ``main``; turn a UserError into one stderr line and exit code 2. Warnings print as one
    ``warning:`` line each, once per message (not Python's file, line and source)."""
    warnings.formatwarning = _warning_line
    warnings.filterwarnings("once", category=UserWarning)
    try:
        rc = main()
    except UserError as e:
        msg = " ".join(str(e).splitlines())   # one line, whatever line breaks a quoted value holds
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(rc or 0)
