"""What every subcommand's parser shares: the one-line argument errors, the help layout, the
option helpers and the limits the commands check."""

from __future__ import annotations

import argparse
from collections.abc import Callable


class _Parser(argparse.ArgumentParser):
    """A wrong argument gets one line that names the option and points to --help (instead
    of the whole usage block)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"edgespec: {message} (see `{self.prog} --help`)\n")


class _Formatter(argparse.HelpFormatter):
    """Shows an option's default where it tells the user something: not for flags, not where
    there is none (``None``: the help text says what happens instead), and not where the help
    text already names it. Descriptions are wrapped to the terminal unless laid out by hand
    (with line breaks, like the epilog's examples)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        nothing = any(action.default is v for v in (None, False, argparse.SUPPRESS))
        if (not action.option_strings or nothing or "%(default)" in text
                or "default" in text.lower()):
            return text
        return text + " (default: %(default)s)"


#: The smallest context a ring's stages accept: they hold up to 256 tree sequences.
MIN_CTX = 256

VERBOSE_HELP = "show tracebacks, debug logging and llama.cpp's own log output"


def _add(sub, name: str, help_text: str, description: str | None = None,
         func: Callable[[argparse.Namespace], int] | None = None) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_text, description=description or help_text,
                       formatter_class=_Formatter)
    # -v at every level (`edgespec -v ring up` and `edgespec ring up -v`); SUPPRESS keeps a
    # sub-command from resetting what an outer level set.
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help=VERBOSE_HELP)
    if func is not None:
        p.set_defaults(func=func)
    return p


def _at_least(low: float, kind: type = int, why: str = "") -> Callable[[str], float]:
    """An argparse type: a number of ``kind`` not below ``low`` (argparse names the option)."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}{why}, got {text}")
        return value

    return parse


def _set_help(parser: argparse.ArgumentParser, option: str, text: str) -> None:
    """Replace the help of ``option`` (an option string, or a positional's name) where the
    argument is defined outside this module."""
    for action in parser._actions:
        if option in action.option_strings or (not action.option_strings
                                               and action.dest == option):
            action.help = text
            return
    raise KeyError(option)
