"""Fixes for the fairseq build this project runs on (ve-fairseq 0.12.3, fairseq main), installed on import.

Each wraps one fairseq or torch entry point without copying it, and is idempotent.
"""

import argparse
import functools
import logging
import os

import numpy as np
import torch

from .common.textio import InputError

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


def switch_task_in_overrides() -> None:
    """``from_pretrained(..., task="fast_step_translation", fast_step=True)`` (fairseq's hub interface, whose
    keyword arguments become ``arg_overrides``) keeps the checkpoint's own task: ``overwrite_args_by_name`` sets
    only keys a config already has, so a task named there, and the flags of that task, are silently dropped:
    a checkpoint trained with ``--task translation`` (the baseline, rnn_fc, bytenet) asked for
    ``fast_step_translation`` or ``rnn_fc_translation`` decodes with the stock generator.
    Where the overrides name another registered task, rebuild ``cfg.task`` as that task's config
    first (the checkpoint's values of the keys the two share kept), as ``--task`` does on the command line;
    the other overrides then reach its flags. fairseq-generate and -interactive build their task from the
    command line and pass no ``task`` override, so they are unchanged.
    """
    from fairseq import checkpoint_utils

    original = checkpoint_utils.overwrite_args_by_name
    if getattr(original, "switches_task", False):
        return

    @functools.wraps(original)
    def overwrite_args_by_name(cfg, overrides):
        name = overrides.get("task") if isinstance(overrides, dict) else None
        task_cfg = cfg.get("task", None) if hasattr(cfg, "get") else None
        if isinstance(name, str) and task_cfg is not None and hasattr(task_cfg, "keys") \
                and task_cfg.get("_name", None) != name:
            _switch_task(cfg, name)
        return original(cfg, overrides)

    overwrite_args_by_name.switches_task = True
    checkpoint_utils.overwrite_args_by_name = overwrite_args_by_name


def reuse_hub_generators() -> None:
    """fairseq's hub interface (``from_pretrained``'s ``hub.translate``/``sample``/``generate``) deep-copies its
    whole generation config and builds a new generator on every call: 0.7 ms and more a call, against 4.6 ms for
    a whole int8 greedy sentence of the fast step. ``from_pretrained`` returns the subclass
    ``reused_generators.reusing_hub_interface()`` instead, which keeps the copy for the same call settings when
    the task reuses its generators (``--fast-step``); for every other task it is fairseq's class unchanged."""
    from fairseq import hub_utils

    from .common.reused_generators import reusing_hub_interface

    if getattr(hub_utils.GeneratorHubInterface, "reuses_generators", False):
        return
    hub_utils.GeneratorHubInterface = reusing_hub_interface()


def _switch_task(cfg, name: str) -> None:
    import copy

    from fairseq.dataclass.utils import merge_with_parent
    from fairseq.tasks import TASK_DATACLASS_REGISTRY
    from omegaconf import open_dict

    if name not in TASK_DATACLASS_REGISTRY:
        raise InputError(f"task={name!r}: no such fairseq task (a plugin task needs user_dir=, or "
                         "`import fairseq_plugins` first)")
    task_cfg = merge_with_parent(TASK_DATACLASS_REGISTRY[name](), copy.deepcopy(cfg.task), remove_missing=True)
    with open_dict(cfg):
        cfg.task = task_cfg
        cfg.task._name = name


# The checkpoint's extra_state key that carries fairseq-train's early-stopping count across a resume.
PATIENCE_STATE_KEY = "fairseq_plugins_patience"


def keep_patience_across_resumes() -> None:
    """fairseq-train's ``--patience`` counts the validations without improvement in attributes of its function
    ``should_stop_early``, which no checkpoint saves: a resumed training compares against the first validation
    after the resume instead of the best one, and counts from 0 again, so a run resumed every few epochs never
    stops at its plateau, and re-running one that patience stopped trains at least ``--patience`` more epochs.
    Save the count (and the best loss it compares against) in every checkpoint's extra_state and restore it
    where fairseq restores ``save_checkpoint.best`` (not with --reset-optimizer or --reset-meters, as fairseq).
    A checkpoint saved without it resumes with the checkpoint's best loss and a count of 0."""
    from fairseq.trainer import Trainer

    if getattr(Trainer.save_checkpoint, "keeps_patience", False):
        return
    original_save, original_load = Trainer.save_checkpoint, Trainer.load_checkpoint

    @functools.wraps(original_save)
    def save_checkpoint(self, filename, extra_state):
        counting = [function for function in _early_stopping_functions() if hasattr(function, "num_runs")]
        if counting:  # the running one comes first
            extra_state = {**extra_state, PATIENCE_STATE_KEY: {"best": counting[0].best,
                                                               "num_runs": counting[0].num_runs}}
        return original_save(self, filename, extra_state)

    @functools.wraps(original_load)
    def load_checkpoint(self, filename, reset_optimizer=False, reset_lr_scheduler=False, optimizer_overrides=None,
                        reset_meters=False):
        extra_state = original_load(self, filename, reset_optimizer, reset_lr_scheduler, optimizer_overrides,
                                    reset_meters)
        if extra_state is not None and not reset_optimizer and not reset_meters:
            state = extra_state.get(PATIENCE_STATE_KEY)
            if state is None and extra_state.get("best") is not None:
                state = {"best": extra_state["best"], "num_runs": 0}
            if state is not None:
                for function in _early_stopping_functions():
                    function.best, function.num_runs = state["best"], state["num_runs"]
                logger.info("early stopping resumes at %d validation(s) without improvement on %s",
                            state["num_runs"], state["best"])
        return extra_state

    save_checkpoint.keeps_patience = True
    Trainer.save_checkpoint, Trainer.load_checkpoint = save_checkpoint, load_checkpoint


def _early_stopping_functions() -> list:
    """fairseq-train's ``should_stop_early``: in __main__ when run with -m (first: the one that runs), else in
    fairseq_cli.train."""
    functions = [getattr(module, "should_stop_early", None) for module in _fairseq_train_modules()]
    return list({id(function): function for function in functions if callable(function)}.values())


def _fairseq_train_modules() -> list:
    """The loaded modules that may hold fairseq-train's functions: __main__ (first: the one running when
    fairseq-train is run with -m), then fairseq_cli.train."""
    import sys

    return [sys.modules[name] for name in ("__main__", "fairseq_cli.train") if name in sys.modules]


def keep_the_wall_clock_across_mid_epoch_resumes() -> None:
    """Resumed from a checkpoint saved inside an epoch (FAIRSEQ_PLUGINS_SAVE_LAST_UPDATES, --save-interval-updates,
    a --stop-time-hours stop), fairseq-train loads the saved metrics, among them its "wall" stopwatch, stopped:
    it then logs ``wall 0`` for the rest of the process. Keep the clock running from this process's start, as
    after an end-of-epoch checkpoint (whose metrics fairseq does not load)."""
    from fairseq.logging import metrics
    from fairseq.trainer import Trainer

    if getattr(Trainer.load_checkpoint, "keeps_the_wall_clock", False):
        return
    original_load = Trainer.load_checkpoint

    @functools.wraps(original_load)
    def load_checkpoint(self, *args, **kwargs):
        started = getattr(metrics.get_meter("default", "wall"), "start_time", None)
        extra_state = original_load(self, *args, **kwargs)
        wall = metrics.get_meter("default", "wall")
        if started is not None and wall is not None and getattr(wall, "start_time", 0) is None:
            wall.start_time = started
        return extra_state

    load_checkpoint.keeps_the_wall_clock = True
    Trainer.load_checkpoint = load_checkpoint


SAVE_LAST_UPDATES_ENV = "FAIRSEQ_PLUGINS_SAVE_LAST_UPDATES"
MID_EPOCH_SAVE_LINE = "saved checkpoint_last mid-epoch: epoch {epoch} @ {updates} updates | wall {wall}"


def save_last_checkpoint_mid_epoch() -> None:
    """fairseq-train saves a checkpoint at the end of each epoch; ``--save-interval-updates`` saves mid-epoch
    too, but validates at every such save, which moves ``--patience`` (it counts validations), the best
    checkpoint and the epoch curves. A training killed mid-epoch (a machine taken back, a session's end) loses
    the whole epoch so far. With ``FAIRSEQ_PLUGINS_SAVE_LAST_UPDATES=N`` (N > 0) checkpoint_last.pt is also
    written every N updates within an epoch, without validating: no epoch checkpoint, no best, no patience
    count moves, and a resumed run goes on from there on the path it would have taken (fairseq seeds every
    update and restores the data iterator's position). Each such save logs its epoch, updates and the process's
    ``wall`` seconds, which examples/results/training_curves.py counts as training time. N counts updates, not
    minutes, so every rank of a distributed training saves at the same update. Unset or 0: fairseq's own saves.

    fairseq-train's loop calls ``validate_and_save`` of its own module (fairseq_cli.train, or __main__ when run
    with -m), looked up at every call: it is wrapped there when an epoch begins (once), whichever of fairseq and
    this package was imported first."""
    from fairseq.trainer import Trainer

    if getattr(Trainer.begin_epoch, "saves_last_mid_epoch", False):
        return
    original_begin_epoch = Trainer.begin_epoch

    @functools.wraps(original_begin_epoch)
    def begin_epoch(self, epoch):
        _save_last_updates()  # a bad value stops the training before its first update
        _wrap_validate_and_save()
        return original_begin_epoch(self, epoch)

    begin_epoch.saves_last_mid_epoch = True
    Trainer.begin_epoch = begin_epoch


def _wrap_validate_and_save() -> None:
    for module in _fairseq_train_modules():
        original = getattr(module, "validate_and_save", None)
        code = getattr(original, "__code__", None)
        if code is not None and code.co_filename.replace(os.sep, "/").endswith("fairseq_cli/train.py"):
            module.validate_and_save = _saving_last_mid_epoch(original)


def _saving_last_mid_epoch(original):
    @functools.wraps(original)
    def validate_and_save(cfg, trainer, task, epoch_itr, valid_subsets, end_of_epoch):
        valid_losses, should_stop = original(cfg, trainer, task, epoch_itr, valid_subsets, end_of_epoch)
        every = _save_last_updates()
        updates = trainer.get_num_updates()
        interval = cfg.checkpoint.save_interval_updates
        saved_by_fairseq = end_of_epoch or should_stop or (
            interval > 0 and updates % interval == 0 and updates >= cfg.dataset.validate_after_updates)
        writes_last = not (cfg.checkpoint.no_save or cfg.checkpoint.no_last_checkpoints)
        # (an update skipped on an fp16 overflow leaves the count where it was: one save per count)
        if every > 0 and updates > 0 and updates % every == 0 and not saved_by_fairseq and writes_last \
                and updates != getattr(validate_and_save, "saved_at", None):
            from fairseq import checkpoint_utils
            from fairseq.logging import metrics

            checkpoint_utils.save_checkpoint(cfg.checkpoint, trainer, epoch_itr, None)
            validate_and_save.saved_at = updates
            logger.info(MID_EPOCH_SAVE_LINE.format(epoch=epoch_itr.epoch, updates=updates,
                                                   wall=round(metrics.get_meter("default", "wall").elapsed_time)))
        return valid_losses, should_stop

    validate_and_save.saves_last_mid_epoch = True
    return validate_and_save


def _save_last_updates() -> int:
    value = os.environ.get(SAVE_LAST_UPDATES_ENV, "").strip() or "0"
    if not value.isdigit():
        raise InputError(f"{SAVE_LAST_UPDATES_ENV}={value!r}: expected a whole number of updates (0: off)")
    return int(value)
