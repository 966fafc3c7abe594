"""RnnFcGenerator: fairseq's beam search (search.py) over a step model (steppers.py), with candidate lists,
int8 matmuls and early stopping; for rnn_fc models also the exact speedups, each a switch.

Statistics for ``fairseq-plugins bench`` (generation_stats) and the exit log: decoder steps, row calls (model
calls; one per step when batched), candidate-list sizes, sentences stopped early.
"""

import logging
from typing import Dict, Optional

import torch

from ..common.generation import MethodGenerator
from .model import RnnFcModel
from .search import BeamSearch
from ..candidates import Shortlist
from .steppers import SPEEDUPS, FairseqStepper, RnnFcStepper

logger = logging.getLogger(__name__)


class RnnFcGenerator(MethodGenerator):
    method_name = "rnn_fc"

    def __init__(self, models, tgt_dict, beam: int = 6, speedups=SPEEDUPS, precompute_words: int = 20000,
                 precision: str = "fp32", shortlist: Optional[Shortlist] = None,
                 early_stop_delta: Optional[float] = None, **search_args):
        if len(models) != 1:
            raise ValueError("rnn_fc decoding takes one model (no ensembles)")
        model = models[0]
        if isinstance(model, RnnFcModel):
            self.stepper = RnnFcStepper(model, speedups, precompute_words, precision)
        else:
            if set(speedups) != set(SPEEDUPS):
                raise ValueError(f"--rnn-fc-speedups: the exact speedups are rnn_fc's own; {type(model).__name__} "
                                 "takes candidate lists, int8 and early stopping only")
            self.stepper = FairseqStepper(model, precision)
        self.model = model
        self.tgt_dict = tgt_dict
        self.pad, self.eos = tgt_dict.pad(), tgt_dict.eos()  # fairseq-generate reads the generator's eos
        self.shortlist = shortlist
        self.search = BeamSearch(tgt_dict, beam=beam, early_stop_delta=early_stop_delta,
                                 max_len=model.max_decoder_positions(), **search_args)
        self.settings = {"speedups": sorted(speedups) if isinstance(model, RnnFcModel) else [],
                         "precision": precision, "shortlist": shortlist is not None,
                         "early_stop_delta": early_stop_delta, "beam": beam,
                         "precomputed_words": getattr(self.stepper, "precomputed_words", 0)}
        self.reset_generation_stats()

    def reset_generation_stats(self) -> None:
        self._stats = {"sentences": 0, "batches": 0, "steps": 0, "row_calls": 0, "candidates": 0,
                       "stopped_early": 0}

    def generation_stats(self) -> Dict:
        stats = dict(self._stats, **self.settings)
        if stats["batches"]:
            stats["steps_per_batch"] = stats["steps"] / stats["batches"]
            stats["model_calls_per_step"] = stats["row_calls"] / max(stats["steps"], 1)
        if stats["sentences"] and self.shortlist is not None:
            stats["candidates_per_sentence"] = stats["candidates"] / stats["sentences"]
        return stats

    def _log_summary(self) -> None:
        stats = self.generation_stats()
        if stats["sentences"]:
            logger.info("rnn_fc decoding: %d sentences, %.1f steps a batch, %.2f model calls a step, %s; %d stopped "
                        "early%s", stats["sentences"], stats["steps_per_batch"], stats["model_calls_per_step"],
                        ", ".join(f"{key}={stats[key]}" for key in ("speedups", "precision", "early_stop_delta")),
                        stats["stopped_early"],
                        f", {stats['candidates_per_sentence']:.0f} candidates a sentence" if self.shortlist else "")

    @torch.no_grad()
    def generate(self, models, sample, prefix_tokens=None, constraints=None, bos_token=None, **kwargs):
        self._begin_generate(prefix_tokens, constraints)
        src_tokens = sample["net_input"]["src_tokens"]
        candidates = valid = None
        if self.shortlist is not None:
            candidates, valid = self.shortlist.candidates(src_tokens)
            self._stats["candidates"] += int(valid.sum())
        hypotheses = self.search.search(self.stepper, sample, candidates, valid)
        self._stats["sentences"] += src_tokens.size(0)
        self._stats["batches"] += 1
        self._stats["steps"] += self.search.steps
        self._stats["row_calls"] += self.stepper.row_calls
        self._stats["stopped_early"] += self.search.stopped_early
        return hypotheses
