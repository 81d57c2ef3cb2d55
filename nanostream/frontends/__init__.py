"""Frontends: programs built only on ``AsyncClient``, started by ``nanostream frontend NAME``.

A frontend is a ``Frontend`` subclass registered under the ``nanostream.frontends`` entry-point group,
so a third-party package adds one without touching nanostream. In its ``pyproject.toml``::

    [project.entry-points."nanostream.frontends"]
    myui = "my_package.ui:MyFrontend"

then ``nanostream frontend myui --engine ipc:///run/nanostream.sock [its options]`` runs it and
``nanostream frontend --list`` shows it. nanostream's own (``openai``, ``gradio``, ``chat``) are
registered the same way.
"""

from __future__ import annotations

import argparse
from abc import ABC, abstractmethod
from importlib.metadata import EntryPoint, entry_points

ENTRY_POINT_GROUP = "nanostream.frontends"


class Frontend(ABC):
    """One program that talks to an engine through ``AsyncClient``.

    ``nanostream frontend NAME`` builds an argument parser with ``--engine`` (default: the
    ``NANOSTREAM_ADDRESS`` environment variable), lets the frontend add its own options, then calls
    ``run`` with the parsed arguments. ``run`` blocks until the program ends and returns its exit code.
    """

    description: str = ""
    """One line for ``nanostream frontend --list``."""

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add this frontend's own options (``--engine`` is already there)."""
        return

    @abstractmethod
    def run(self, args: argparse.Namespace) -> int:
        """Run until done (or Ctrl-C); ``args.engine`` is the engine's address. Returns the exit code."""


def registered() -> dict[str, EntryPoint]:
    """Every registered frontend's entry point, by name."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def load(name: str) -> type[Frontend]:
    """The frontend class registered as ``name``; ValueError naming the registered ones otherwise."""
    found = registered()
    if name not in found:
        known = ", ".join(sorted(found)) or "none"
        raise ValueError(f"no frontend named {name!r}; registered frontends: {known}")
    cls = found[name].load()
    if not (isinstance(cls, type) and issubclass(cls, Frontend)):
        raise TypeError(f"entry point {found[name].value!r} of frontend {name!r} is not a nanostream Frontend")
    return cls


def frontend_main(name: str, argv: list[str], prog: str | None = None) -> int:
    """Parse ``argv`` for the frontend ``name`` (``--engine`` plus its own options) and run it."""
    cls = load(name)
    parser = argparse.ArgumentParser(prog=prog or f"nanostream frontend {name}", description=cls.description)
    parser.add_argument(
        "--engine",
        metavar="ADDR",
        help="the engine's address (default: $NANOSTREAM_ADDRESS, else the one engine `nanostream serve` runs here)",
    )
    cls.add_arguments(parser)
    return cls().run(parser.parse_args(argv))
