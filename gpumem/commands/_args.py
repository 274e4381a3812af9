"""Argument behaviour shared by every ``gpumem`` command.

Note [Options behave the same in every command]: an option that takes several values takes them both
ways, ``--policy A B`` and ``--policy A --policy B`` (argparse's ``extend`` action with ``nargs="+"``:
:data:`MANY`), in every command; and an option that takes one value refuses to be given twice with a
usage error, instead of silently keeping the last one (:func:`refuse_repeated_options`, applied once to
the whole parser). Nothing the user typed is dropped without a word.
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence

#: Keyword arguments of ``add_argument`` for an option that takes one or more values, repeatable.
MANY: dict[str, Any] = {"action": "extend", "nargs": "+"}


class _StoreOnce(argparse._StoreAction):
    """``store`` that refuses a second occurrence of its option (Note [Options behave the same in every command])."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        seen: set[str] = namespace.__dict__.setdefault("_options_seen", set())
        if self.dest in seen:
            parser.error(f"{'/'.join(self.option_strings)} given twice: it takes one value "
                         f"(the second was {values!r})")
        seen.add(self.dest)
        super().__call__(parser, namespace, values, option_string)


def refuse_repeated_options(parser: argparse.ArgumentParser) -> None:
    """Make every single-value option of ``parser`` and of its subcommands refuse a second occurrence."""
    for action in parser._actions:
        if type(action) is argparse._StoreAction and action.option_strings:
            action.__class__ = _StoreOnce
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                refuse_repeated_options(sub)


class _HintingParser(argparse.ArgumentParser):
    """A subcommand's parser whose "required: TRACE" error says why the trace may be missing: an option that
    takes several values (:data:`MANY`) took it (``gpumem report --device A TRACE --out D``: the trace became
    a second device)."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        if "the following arguments are required:" in message:
            positionals = [a for a in self._actions if not a.option_strings and a.required]
            many = [a.option_strings[-1] for a in self._actions
                    if a.option_strings and isinstance(a, argparse._ExtendAction)]
            missing = [a for a in positionals if (a.metavar or a.dest) in message]
            if missing and many:
                name = (missing[0].metavar or missing[0].dest).upper()
                message += (f" (options that take several values, {', '.join(many)}, take every word up to the "
                            f"next option: give {name} before them, e.g. `{self.prog} {name} {many[0]} ...`)")
        super().error(message)


def hint_swallowed_positionals(parser: argparse.ArgumentParser) -> None:
    """Make every subcommand of ``parser`` with a required positional and an option of :data:`MANY` say, when
    the positional is missing, that such an option may have taken it (:class:`_HintingParser`)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                if type(sub) is argparse.ArgumentParser:
                    sub.__class__ = _HintingParser


def strip_bookkeeping(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` without the record :class:`_StoreOnce` keeps of the options it saw."""
    args.__dict__.pop("_options_seen", None)
    return args


__all__: Sequence[str] = ["MANY", "hint_swallowed_positionals", "refuse_repeated_options", "strip_bookkeeping"]
