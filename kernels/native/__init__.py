"""llmd's C kernels for CPUs: sources shipped in the package, built on first use (:mod:`.build`)."""
