"""Option parsing the ``llmd bench ...`` commands share: comma-separated lists checked by click
(a one-line usage error before any weights load) and ``--min-X`` <= ``--max-X`` pairs."""

from __future__ import annotations

import click

from llmd.daemon.core.errors import LlmdError


def check_ranges(**bounds: int) -> None:
    """``--min-X`` <= ``--max-X`` for each pair given as ``min_X=..., max_X=...``, before any weights load.

    Raises:
        LlmdError: one naming both options and values.
    """
    for name, lo in bounds.items():
        if name.startswith("min_") and lo > bounds["max_" + name[4:]]:
            what = name[4:]
            raise LlmdError(f"--min-{what} ({lo}) must be <= --max-{what} ({bounds['max_' + what]})")


def int_list(ctx, param, value):
    try:
        out = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"comma-separated integers expected, got {value!r}") from None
    if not out or min(out) < 1:
        raise click.BadParameter(f"positive integers expected, got {value!r}")
    return out


def name_list(ctx, param, value):
    return [x.strip() for x in value.split(",") if x.strip()]


def choice_list(*choices: str):
    """A click callback: a comma-separated list of ``choices``; an unknown name is click's
    one-line usage error, before any weights load or the bandwidth probe runs."""
    def callback(ctx, param, value):
        names = name_list(ctx, param, value)
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise click.BadParameter(f"{', '.join(bad) or 'nothing'} is not one of {', '.join(choices)}")
        return names
    return callback
