"""The ``gpumem`` subcommands, one module each (what they share: :mod:`gpumem.commands._common`).

Each module named in :data:`COMMAND_MODULES` defines ``register(sub, formatter_class)``, which adds its
parser to ``sub`` (the ``argparse`` subparsers of :func:`gpumem.cli.build_parser`) and sets ``func`` to a
function taking the parsed arguments and returning the exit status. Errors that are gpumem's own
(:class:`~gpumem.errors.GpumemError`) may propagate: :func:`gpumem.cli.main` turns them into one line on
stderr and the documented exit status.
"""

from __future__ import annotations

COMMAND_MODULES: tuple[str, ...] = (
    "devices",
    "replay",
    "info",
    "workspace",
    "estimate",
    "fit",
    "report",
    "sweep",
    "record",
)
"""Submodules of :mod:`gpumem.commands`, in the order ``gpumem --help`` lists them."""
