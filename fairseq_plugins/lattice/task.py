"""``lattice_translation``: fairseq's translation task whose generator decodes a ``lattice_transformer``
through a candidate lattice and Viterbi (LatticeGenerator) instead of left-to-right search.

Training needs nothing from this task (``--task translation`` trains the model just as well); decoding
needs ``--lattice-table``, the file ``fairseq-plugins lattice-table`` built from the same dictionaries.
"""

import logging
from dataclasses import dataclass, field
from typing import Optional

from fairseq.dataclass import ChoiceEnum
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from ..common.generation import generator_options, refuse_unsupported_generation_flags
from ..common.textio import InputError
from ..common.warm_start import warm_start_built_model
from ..kernels.int8 import int8_encoder_unsupported_reason, int8_model_unsupported_reason
from ..kernels.precision import PRECISIONS
from .generator import NORMALIZATIONS, LatticeGenerator
from .ibm2 import CandidateTable
from .model import LatticeTransformerModel, scorer_int8_unsupported_reason

logger = logging.getLogger(__name__)


@dataclass
class LatticeTranslationConfig(TranslationConfig):
    lattice_table: str = field(
        default="", metadata={"help": "candidate table from `fairseq-plugins lattice-table` (needed to decode)"},
    )
    lattice_k: int = field(default=64, metadata={"help": "candidates per target position (the lattice's width K)"})
    lattice_mass: float = field(
        default=1.0,
        metadata={"help": "adaptive K: keep at each position only the most likely candidates needed to reach this "
                          "share of the position's table probability (at least 1, at most --lattice-k); fewer "
                          "candidates, fewer rows to score. 1 keeps all K"},
    )
    lattice_beam: int = field(
        default=0,
        metadata={"help": "with --no-repeat-ngram-size: paths kept by the beam search over the scored lattice that "
                          "replaces Viterbi (whose states do not hold the history the rule needs); 0: K"},
    )
    lattice_length_delta: int = field(
        default=3, metadata={"help": "decode every length L - dL .. L + dL around the table's length estimate L"},
    )
    lattice_normalize: ChoiceEnum(list(NORMALIZATIONS)) = field(
        default="lattice",
        metadata={"help": "softmax of each edge score over: lattice (the next position's K candidates and EOS; "
                          "K dot products a row) or vocab (the whole vocabulary, as in training; V a row)"},
    )
    lattice_no_hoist: bool = field(
        default=False,
        metadata={"help": "score the lattice with the scorer's own layers, as in training, instead of the hoisted "
                          "inference path (per-vocabulary and per-position tables of the first layer, the "
                          "cross-attention output projection folded into the memory once per sentence): the "
                          "same scores up to float rounding, slower; for checking"},
    )
    lattice_scorer_precision: ChoiceEnum(list(PRECISIONS)) = field(
        default="fp32",
        metadata={"help": "precision of the scorer's feed-forward matrices (fc1, fc2 of every scorer layer; most of "
                          "the scoring time): fp32, or int8 weights with per-row activation scales (fbgemm, CPU and "
                          "float32 models only; quantized once when the generator is built; scores move by int8 "
                          "rounding). Runs on the hoisted scorer (not with --lattice-no-hoist or --retain-dropout)"},
    )
    lattice_encoder_precision: ChoiceEnum(list(PRECISIONS)) = field(
        default="fp32",
        metadata={"help": "precision of the encoder's matrices: fp32, or int8 (every layer's self-attention and "
                          "feed-forward matrices with per-row activation scales, fairseq_plugins.kernels.int8's "
                          "encoder, as the fast step's; CPU and float32 models only; about half the encoder's time "
                          "here)"},
    )
    lattice_cuda_graphs: bool = field(
        default=False, metadata={"help": "the model on a CUDA device: the encoder and the lattice's scoring as one "
                                         "CUDA graph per shape (batch size; source length and lattice positions "
                                         "padded to multiples of 16), captured at its "
                                         "first use and replayed after; the same outputs. float32 or half "
                                         "models, the hoisted scorer. Off by default: its speed is not measured yet"},
    )
    lattice_base_checkpoint: Optional[str] = field(
        default=None, metadata={"help": "training: warm-start the encoder and the target embeddings (and output "
                                        "matrix) from this trained fairseq transformer of the same sizes and data "
                                        "(e.g. the baseline's); the scorer keeps its initialisation. The encoder "
                                        "may have more layers than the base's: those above keep theirs"},
    )


@register_task("lattice_translation", dataclass=LatticeTranslationConfig)
class LatticeTranslationTask(TranslationTask):
    cfg: LatticeTranslationConfig

    def __init__(self, cfg: LatticeTranslationConfig, src_dict, tgt_dict):
        super().__init__(cfg, src_dict, tgt_dict)
        self._table = None

    def build_model(self, cfg, from_checkpoint=False):
        model = super().build_model(cfg, from_checkpoint)
        warm_start_built_model(model, cfg, from_checkpoint, self.cfg.lattice_base_checkpoint,
                               "--lattice-base-checkpoint", LatticeTransformerModel, "lattice_transformer*")
        return model

    def begin_valid_epoch(self, epoch, model):
        """--eval-bleu decodes the validation set with the generator built at the start of training: its hoisted
        tables must follow the weights the optimiser changed through ``param.data``, which their fingerprint
        cannot see."""
        super().begin_valid_epoch(epoch, model)
        generator = getattr(self, "sequence_generator", None)
        if isinstance(generator, LatticeGenerator):
            generator.forget_hoisted_tables()

    def candidate_table(self) -> CandidateTable:
        if self._table is None:
            if not self.cfg.lattice_table:
                raise InputError("--lattice-table: lattice decoding needs the candidate table built by "
                                 "`fairseq-plugins lattice-table` from this data")
            self._table = CandidateTable.load(self.cfg.lattice_table, self.source_dictionary, self.target_dictionary)
            logger.info("lattice table %s: %s", self.cfg.lattice_table, self._table.summary())
        return self._table

    def build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None,
                        prefix_allowed_tokens_fn=None):
        if not all(isinstance(model, LatticeTransformerModel) for model in models):
            names = ", ".join(sorted({type(model).__name__ for model in models}))
            raise InputError(f"--path: --task lattice_translation decodes a lattice_transformer, not {names} "
                             "(decode other models with --task translation)")
        refuse_unsupported_generation_flags(args, "lattice decoding", extra={
            "--unkpen": getattr(args, "unkpen", 0) != 0,
            "--temperature": getattr(args, "temperature", 1.0) != 1.0,
        }, supported=("--no-repeat-ngram-size",))
        device = next(models[0].parameters()).device
        precision = str(self.cfg.lattice_scorer_precision)
        if precision == "int8":
            if self.cfg.lattice_no_hoist:
                raise InputError("--lattice-scorer-precision int8 runs on the hoisted scorer: "
                                 "drop --lattice-no-hoist")
            if getattr(args, "retain_dropout", False):
                raise InputError("--lattice-scorer-precision int8 runs on the hoisted scorer, which dropout kept at "
                                 "inference turns off: drop --retain-dropout")
            reason = scorer_int8_unsupported_reason(models[0].decoder)
            if reason is not None:
                raise InputError(f"--lattice-scorer-precision int8: {reason}")
        encoder_precision = str(self.cfg.lattice_encoder_precision)
        if encoder_precision == "int8":
            reason = int8_model_unsupported_reason(models[0]) or int8_encoder_unsupported_reason(models[0].encoder)
            if reason is not None:
                raise InputError(f"--lattice-encoder-precision int8: {reason}")
        options = generator_options(args, "nbest", "no_repeat_ngram_size")
        del options["unk_penalty"]  # --unkpen is refused above: the lattice's edges are scored without it
        return LatticeGenerator(
            models, self.target_dictionary, self.candidate_table().to(device), k=self.cfg.lattice_k,
            length_delta=self.cfg.lattice_length_delta, normalization=str(self.cfg.lattice_normalize),
            hoist=not self.cfg.lattice_no_hoist, precision=precision, encoder_precision=encoder_precision,
            mass=self.cfg.lattice_mass, beam=self.cfg.lattice_beam, cuda_graphs=self.cfg.lattice_cuda_graphs,
            **options,
        )
