"""fairseq-plugins: fast-translation methods for fairseq, loaded with ``--user-dir fairseq_plugins``.

Importing the package registers every method subpackage with fairseq's registries (once: Python caches
the import) and installs seven fixes (fairseq_fixes.py): checkpoints load under torch >= 2.6,
fairseq-generate decodes every sentence, fairseq's hub interface (``from_pretrained(..., task=NAME)``)
decodes with the task it names and, with --fast-step, reuses its generator from call to call,
fairseq-train's --patience survives a resume, its wall clock survives a mid-epoch resume, and (opt-in,
FAIRSEQ_PLUGINS_SAVE_LAST_UPDATES) it saves checkpoint_last.pt mid-epoch without validating. So
``fairseq-train``, ``fairseq-generate`` and ``fairseq-interactive`` need nothing but ``--user-dir``.
"""

import importlib
import logging
import os

__version__ = "0.1.0"  # setup.py reads it from here

# Importing fairseq logs "Please install tensorboardX" (fairseq.tasks.text_to_speech, at INFO, visible through
# the root handler another fairseq module installs on import) on every command: no method here uses it.
logging.getLogger("fairseq.tasks.text_to_speech").setLevel(logging.WARNING)

try:
    importlib.import_module("fairseq")
except ModuleNotFoundError as error:
    if error.name != "fairseq":
        raise
    raise ImportError("fairseq-plugins needs fairseq, which is not installed: pip install --no-deps "
                      "ve-fairseq==0.12.3 (or `make install` in a clone, which installs everything)") from None

from . import fairseq_fixes  # noqa: E402


def user_dir() -> str:
    """The path to pass to fairseq as ``--user-dir`` (this package's directory)."""
    return os.path.dirname(os.path.abspath(__file__))


fairseq_fixes.allow_fairseq_checkpoints()
fairseq_fixes.keep_last_partial_batch()
fairseq_fixes.switch_task_in_overrides()
fairseq_fixes.reuse_hub_generators()
fairseq_fixes.keep_patience_across_resumes()
fairseq_fixes.keep_the_wall_clock_across_mid_epoch_resumes()
fairseq_fixes.save_last_checkpoint_mid_epoch()

# Method subpackages: each registers its models, tasks and criterions on import. Each also names the
# fairseq task whose generator `fairseq-plugins bench --method NAME` measures (BENCH_TASK).
from . import baseline, blockwise, bytenet, double_token, fast_step, lattice, rnn_fc  # noqa: E402

METHOD_PACKAGES = (baseline, blockwise, bytenet, double_token, fast_step, lattice, rnn_fc)
