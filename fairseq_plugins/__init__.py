"""fairseq-plugins: fast-translation methods for fairseq, loaded with ``--user-dir fairseq_plugins``.

Importing the package registers every method subpackage with fairseq's registries (once: Python caches
the import) and installs the checkpoint-loading fix below, so ``fairseq-train``, ``fairseq-generate`` and
``fairseq-interactive`` need nothing but ``--user-dir``.
"""

import argparse

import torch

__version__ = "0.1.0"


def _allow_fairseq_checkpoints():
    """torch >= 2.6 unpickles with ``weights_only=True``; fairseq checkpoints hold an ``argparse.Namespace``.

    Allow-listing that one class keeps the safe loader for everything else.
    """
    add_safe_globals = getattr(torch.serialization, "add_safe_globals", None)
    if add_safe_globals is not None:  # older torch loads everything and needs no fix
        add_safe_globals([argparse.Namespace])


_allow_fairseq_checkpoints()

# Method subpackages: each registers its models, tasks and criterions on import. Each also names the
# fairseq task whose generator `fairseq-plugins bench --method NAME` measures (BENCH_TASK).
from . import baseline  # noqa: E402

METHOD_PACKAGES = (baseline,)
