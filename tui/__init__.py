"""llmd.tui: ``llmd top``, a Textual dashboard of a running daemon.

``app.py`` (TopApp: polling, reconnection, actions), ``main_screen.py``, ``confirm_screen.py``,
one widget per file (``header_bar``, ``block_map``, ``gauges``, ``rates``, ``request_table``),
pure helpers without Textual (``map_cells``: block map → cells; ``history``: rates and hit
rates over time; ``stats_view``: defensive field access and formatting), styles in ``llmd.tcss``.
"""
