"""Fixes for the fairseq build this project runs on (ve-fairseq 0.12.3, fairseq main), installed on import.

Each wraps one fairseq or torch entry point without copying it, and is idempotent.
"""

import argparse
import functools
import logging
import os

import numpy as np
import torch

logger = logging.getLogger(__name__)


def allow_fairseq_checkpoints() -> None:
    """torch >= 2.6 unpickles with ``weights_only=True``; fairseq checkpoints hold an ``argparse.Namespace``
    (and, trained with --eval-bleu, numpy arrays), and a resuming distributed run sends omegaconf configs.

    Allow-listing those classes keeps the safe loader for everything else.
    """
    add_safe_globals = getattr(torch.serialization, "add_safe_globals", None)
    if add_safe_globals is not None:  # older torch loads everything and needs no fix
        add_safe_globals([argparse.Namespace, *_numpy_array_globals(), *_omegaconf_globals()])


def _omegaconf_globals() -> list:
    """What unpickling fairseq's config objects needs: a distributed run that resumes broadcasts rank 0's loaded
    checkpoint (its ``cfg`` an omegaconf DictConfig) to the other ranks through ``torch.load``."""
    import collections
    import typing

    from fairseq.distributed.utils import _TensorPlaceholder  # what the broadcast puts where tensors were
    from omegaconf import DictConfig, ListConfig, base, nodes

    node_types = [getattr(nodes, name) for name in ("AnyNode", "StringNode", "IntegerNode", "FloatNode",
                                                     "BooleanNode") if hasattr(nodes, name)]
    return [_TensorPlaceholder, DictConfig, ListConfig, base.ContainerMetadata, base.Metadata, *node_types, typing.Any, dict, list,
            int, float, str, bool, collections.defaultdict]


def _numpy_array_globals() -> list:
    """What unpickling a numpy array needs: --eval-bleu stores its n-gram counts as int64 arrays in the
    checkpoint's metrics state, so a model trained with it would not load otherwise."""
    core = getattr(np, "_core", None) or np.core  # numpy 2 renamed the package
    return [core.multiarray._reconstruct, np.ndarray, np.dtype,
            *{type(np.dtype(t)) for t in (np.int64, np.int32, np.float64, np.float32, np.bool_)}]


# Set to 1 to restore fairseq's own batching (the last partial batch dropped), e.g. to reproduce a
# training run made without this package; read at every call, so it may be set after import.
DROP_LAST_PARTIAL_BATCH_ENV = "FAIRSEQ_PLUGINS_DROP_LAST_PARTIAL_BATCH"


def keep_last_partial_batch() -> None:
    """fairseq main's ``batch_by_size`` drops the last batch when its size is not a multiple of
    ``--required-batch-size-multiple`` (default 8; fairseq issue 5036), so ``fairseq-generate`` silently
    skips sentences (39 of 40 at --batch-size 1; 296 of 300 at 64), and fails on an empty index list. Put the
    dropped indices back as a final batch.

    This changes training too: each epoch also trains on the (at most bsz_mult - 1) sentences fairseq would
    drop. ``FAIRSEQ_PLUGINS_DROP_LAST_PARTIAL_BATCH=1`` restores fairseq's behaviour (empty lists still work).
    """
    from fairseq.data import data_utils

    original = data_utils.batch_by_size
    if getattr(original, "keeps_last_partial_batch", False):
        return

    @functools.wraps(original)
    def batch_by_size(indices, *args, **kwargs):
        if not isinstance(indices, np.ndarray):
            indices = np.fromiter(indices, dtype=np.int64, count=-1)
        if len(indices) == 0:  # fairseq's own check indexes the last of no batches
            return []
        batches = original(indices, *args, **kwargs)
        if os.environ.get(DROP_LAST_PARTIAL_BATCH_ENV, "0") not in ("", "0"):
            return batches
        covered = sum(len(batch) for batch in batches)
        if covered < len(indices):  # the dropped batch is always the tail of ``indices``
            batches = list(batches) + [indices[covered:]]
            _log_kept_once(len(indices) - covered)
        return batches

    batch_by_size.keeps_last_partial_batch = True
    data_utils.batch_by_size = batch_by_size


_kept_batch_logged = False


def _log_kept_once(sentences: int) -> None:
    """Training builds batches every epoch: say it once a process."""
    global _kept_batch_logged
    if _kept_batch_logged:
        return
    _kept_batch_logged = True
    logger.info("kept the last partial batch of %d sentences that fairseq drops (fairseq issue 5036); "
                "%s=1 drops it as fairseq does", sentences, DROP_LAST_PARTIAL_BATCH_ENV)
