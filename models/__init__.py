"""llmd.models."""
