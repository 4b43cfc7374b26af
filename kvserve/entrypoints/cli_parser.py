"""The ``kvserve`` command's argument parsers: every default in ``--help``, and a usage error shown with the usage
of the subcommand it was made in (``kvserve bench speed --bogus`` prints ``usage: kvserve bench speed ...``)."""

from __future__ import annotations

import argparse
import copy
from collections.abc import Sequence


class HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: ...)" to an option's help unless the help says it already (or the option is a flag or
    required); an unset option (None, an empty list) shows "none"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        default = _default_text(action)
        help_text = action.help or ""
        return help_text if default is None else f"{help_text} (default: {default})".lstrip()

    def _format_action(self, action: argparse.Action) -> str:
        default = _default_text(action)
        if not action.help and default is not None:  # argparse leaves an option without help out
            action = copy.copy(action)
            action.help = f"(default: {default})"
        return super()._format_action(action)


def _default_text(action: argparse.Action) -> str | None:
    default = action.default
    if not action.option_strings or action.required or "default" in (action.help or ""):
        return None
    if default is False or default is argparse.SUPPRESS or isinstance(action, argparse._VersionAction):
        return None
    return "none" if default is None or default == [] else "%(default)s"


class Parser(argparse.ArgumentParser):
    """The top-level parser; its subcommands are ``SubcommandParser``s."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def add_subparsers(self, **kwargs: object) -> argparse._SubParsersAction:
        kwargs.setdefault("parser_class", SubcommandParser)
        return super().add_subparsers(**kwargs)


class SubcommandParser(Parser):
    """Reports arguments it does not know itself, with its own usage, instead of handing them up to
    ``kvserve``'s parser (whose usage would list the subcommands, not the options the user got wrong)."""

    def parse_known_args(
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras
