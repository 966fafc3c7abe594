"""The matplotlib set-up every results plot shares (registers nothing): the file-only backend, and a PNG
written aside and renamed, so a failed plot never leaves half a file."""

import logging


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display needed), with matplotlib's DEBUG logging quieted:
    fairseq leaves the root logger verbose, and matplotlib's import and font search log at DEBUG."""
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: str, dpi: int = 120) -> None:
    """Write ``fig`` to ``path`` as PNG (aside, then renamed) and close it."""
    from .textio import atomic_output

    with atomic_output(path, mode="wb") as f:
        fig.savefig(f, format="png", dpi=dpi)
    pyplot().close(fig)
