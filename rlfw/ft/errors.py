"""Errors that no replacement cell can fix: the driver stops the run on them instead of healing."""


class FatalError(RuntimeError):
    pass


class StateLostError(FatalError):
    """Every cell holding the trained state died; only a checkpoint can bring it back."""


class BelowMinCellsError(FatalError):
    """Fewer than ft.min_cells cells stayed alive and no replacement became ready before the deadline."""


class WorldLostError(RuntimeError):
    """A rank of a classic world died: Megatron's collectives cannot go on without it, so the job ends and a
    restart (``resume=auto``) continues from the last checkpoint."""


class UnfiredFaultError(RuntimeError):
    """A scheduled kill (``fault=kill_once``) never fired: the run did not test what it was asked to."""


class JobError(FatalError):
    """An error of the job (its disk, its data), not of a cell: every cell would fail the same way."""


class FencedError(RuntimeError):
    """A cell the driver took out of the run (rlfw.ft.membership) tried to take part again; it is refused."""
