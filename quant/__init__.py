"""llmd.quant."""
