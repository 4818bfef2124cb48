"""llmd.tui."""
