"""Scorers: the protocol (`base`), the built-in ones, and building one by name or import path (`registry`)."""
