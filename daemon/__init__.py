"""llmd.daemon."""
