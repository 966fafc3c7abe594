"""The project's beam search with Devlin (2017)'s early stopping over the fast decoder step
(``--fast-step-early-stop``): ``common/beam_search.py``'s search (fairseq's search otherwise, the one rnn_fc
decodes with), its steps made by ``FastDecoderStep`` (``FastStepStepper``). Without early stopping the task
decodes with fairseq's own search on the same step (``kernels.sequence_generator``).
"""

from typing import Dict, Optional

import torch.nn.functional as F
from torch import Tensor

from ..common.beam_search import BeamSearchGenerator, flat_rows
from ..common.textio import InputError
from ..kernels.decoder_step import fast_step_parts


class FastStepStepper:
    """``FastDecoderStep`` as the step model of ``common/beam_search.py``: the rows of a step are each
    sentence's hypotheses, and the caches follow each new hypothesis' parent."""

    def __init__(self, model, precision: str = "fp32"):
        self.model = model
        self.engine, self.encoder = fast_step_parts(model, precision)
        self.rows = 1
        self.row_calls = 0

    def start(self, sample: Dict, candidates: Optional[Tensor], candidate_valid: Optional[Tensor] = None) -> None:
        self.engine.start(self.encoder.forward_torchscript(sample["net_input"]))
        self.engine.output.prepare(candidates, candidate_valid)
        self.rows = 1  # hypotheses a sentence: one at the first step
        self.row_calls = 0

    def step(self, tokens: Tensor, parents: Optional[Tensor]) -> Tensor:
        batch, k = tokens.shape
        if parents is not None:
            self.engine.reorder(flat_rows(parents, self.rows))
        self.rows = k
        logits = self.engine.logits(self.engine.step(tokens.reshape(-1)))
        self.row_calls += 1
        return F.log_softmax(logits.float(), dim=-1).view(batch, k, -1)


class FastStepEarlyStoppingGenerator(BeamSearchGenerator):
    """The project's beam search with early stopping (``early_stop_delta``) over ``FastDecoderStep``: with an
    infinite delta, fairseq's hypotheses."""

    method_name = "fast step"

    def __init__(self, models, tgt_dict, beam: int = 5, precision: str = "fp32", shortlist=None,
                 early_stop_delta: float = 3.0, **search_args):
        if len(models) != 1:
            raise InputError("--fast-step runs one model, not an ensemble")
        super().__init__(models[0], tgt_dict, FastStepStepper(models[0], precision), beam=beam, shortlist=shortlist,
                         early_stop_delta=early_stop_delta, settings={"precision": precision}, **search_args)
