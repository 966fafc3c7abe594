"""Progress bars of the subcommands' long steps, drawn as ``fairseq-plugins bench`` draws its timed runs: tqdm on
stderr, cleared when the step ends. The library functions draw them only when asked (``progress=True``, as the
subcommands ask): called from code or tests they stay silent."""

from tqdm import tqdm


def progress_bar(iterable=None, enabled: bool = True, **kwargs) -> tqdm:
    """A tqdm bar (``desc``, ``total``, ``unit`` ... as tqdm takes them); disabled, it draws nothing and costs
    next to nothing, so a caller needs no second code path."""
    return tqdm(iterable, leave=False, disable=not enabled, **kwargs)
