"""Reference models loaded for parity tests (the official code, run on pure-torch stand-ins)."""
