"""
What keeps a run folder whole while a run writes it (docs/reliability.md), and how a run that cannot go on stops.
"""

# The exit status of a training run whose loss or weights became non-finite, so that a caller (the study's grid)
# tells a diverged run from a failed one without reading its words.
EXIT_DIVERGED = 3


class Diverged(Exception):
    """The loss or the weights became non-finite; the message says which checkpoint is kept and what to do."""
