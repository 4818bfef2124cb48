"""llmd.daemon.cli: the ``llmd`` command line (click).

``main`` (the group, one-line usage errors; the console script's entry point), ``common``
(one-line errors, shared options, engine building) and one module per command family.
"""
