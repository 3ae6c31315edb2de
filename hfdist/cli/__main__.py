"""`python -m hfdist.cli VERB ...` (how a hand-over starts each rank of an installed hfdist)."""

from hfdist.cli import entry

entry()
