"""Loading pickles that cannot run code.

A pickle is a small program: its ``GLOBAL``/``STACK_GLOBAL`` opcodes import any
callable (``os.system``, ``builtins.eval``) and ``REDUCE`` calls it. Every such
import goes through :meth:`pickle.Unpickler.find_class`, so an unpickler whose
``find_class`` always refuses can only build what the pickle machine makes
natively: ``dict``, ``list``, ``tuple``, ``set``, ``frozenset``, ``str``,
``bytes``, ``bytearray``, ``int``, ``float``, ``bool`` and ``None``. That is
all a PyTorch memory snapshot contains.

:func:`load_plain_pickle` reads such a file (gzipped or not, detected by content)
and turns every failure -- a forbidden global, a persistent id, a truncated or
corrupt stream -- into :class:`~gpumem.errors.TraceFormatError` naming the file.
"""

from __future__ import annotations

import pickle
from typing import Any

from ..errors import TraceFormatError
from ._fileio import PathLike, open_binary

__all__ = ["PlainUnpickler", "load_plain_pickle"]


class PlainUnpickler(pickle.Unpickler):
    """An unpickler that refuses every global, so loading never imports or calls anything."""

    def __init__(self, file: Any, *, path: str = "<pickle>") -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        raise TraceFormatError(
            self._path,
            f"forbidden global {module}.{name} in pickle: only plain containers and scalars are allowed "
            "(the file may be trying to run code)",
        )

    def persistent_load(self, pid: Any) -> Any:
        raise TraceFormatError(self._path, "pickle uses persistent ids, which a memory snapshot never does")


def load_plain_pickle(path: PathLike) -> Any:
    """Unpickle ``path`` (gzip detected by content) admitting only plain data; see the module docstring."""
    name = str(path)
    with open_binary(path) as f:
        try:
            return PlainUnpickler(f, path=name).load()
        except TraceFormatError:
            raise
        except RecursionError as e:
            raise TraceFormatError(name, "pickle nests too deeply") from e
        except Exception as e:  # any failure of the C unpickler on untrusted bytes is a format error
            raise TraceFormatError(name, f"not a readable pickle ({type(e).__name__}: {e})") from e
