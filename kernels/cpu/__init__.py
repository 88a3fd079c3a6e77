"""CPU kernels built from C at first use (see each module's docstring)."""
