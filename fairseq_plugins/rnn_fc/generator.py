"""RnnFcGenerator: the project's beam search (common/beam_search.py) over a step model (steppers.py), with
candidate lists, int8 matmuls and early stopping; for rnn_fc models also the exact speedups, each a switch.
"""

from typing import Optional

from ..common.beam_search import BeamSearchGenerator
from ..common.textio import InputError
from ..kernels.shortlist import Shortlist
from .model import RnnFcModel
from .steppers import SPEEDUPS, FairseqStepper, RnnFcStepper


class RnnFcGenerator(BeamSearchGenerator):
    method_name = "rnn_fc"

    def __init__(self, models, tgt_dict, beam: int = 6, speedups=SPEEDUPS, precompute_words: int = 20000,
                 precision: str = "fp32", shortlist: Optional[Shortlist] = None,
                 early_stop_delta: Optional[float] = None, **search_args):
        if len(models) != 1:
            raise InputError("rnn_fc decoding takes one model (no ensembles)")
        model = models[0]
        if isinstance(model, RnnFcModel):
            stepper = RnnFcStepper(model, speedups, precompute_words, precision)
        else:
            if set(speedups) != set(SPEEDUPS):
                raise InputError(f"--rnn-fc-speedups: the exact speedups are rnn_fc's own; {type(model).__name__} "
                                 "takes candidate lists, int8 and early stopping only")
            stepper = FairseqStepper(model, precision)
        settings = {"speedups": sorted(speedups) if isinstance(model, RnnFcModel) else [], "precision": precision,
                    "precomputed_words": getattr(stepper, "precomputed_words", 0)}
        super().__init__(model, tgt_dict, stepper, beam=beam, shortlist=shortlist, early_stop_delta=early_stop_delta,
                         settings=settings, **search_args)
