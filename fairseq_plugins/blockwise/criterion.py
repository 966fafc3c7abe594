"""``blockwise_label_smoothed_cross_entropy``: label-smoothed cross entropy of every proposal head.

Head i (1-based) at decoder position j predicts target token j + i - 1, so its targets are the reference
shifted left by i - 1 (positions past the end are padding and ignored). The loss is the mean of the heads'
losses or, with ``--blockwise-loss sample``, the loss of one head drawn uniformly per batch (the paper's
unbiased estimate of that mean, which computes one head's logits instead of k). Validation always scores
every head. Each head's loss and accuracy are logged as ``head<i>_nll_loss`` and ``head<i>_accuracy``, and
the mean accuracy of heads 2..k as ``proposal_accuracy`` (a checkpoint metric for frozen-base training).

Fine-tuning (base unfrozen, or a learned p_1): p_1 is trained in every batch (with ``sample``, p_1's loss plus
one other head's), and ``--blockwise-teacher-checkpoint`` adds ``--blockwise-teacher-weight`` times the KL
divergence from the frozen teacher's distribution (the base before fine-tuning) to p_1's, so p_1 stays
close to the model whose greedy output the heads were trained to predict.
"""

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from fairseq import metrics, utils
from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
    label_smoothed_nll_loss,
)
from fairseq.dataclass import ChoiceEnum

from ..common.textio import InputError

BLOCKWISE_LOSS_CHOICES = ChoiceEnum(["mean", "sample"])


@dataclass
class BlockwiseLabelSmoothedCrossEntropyConfig(LabelSmoothedCrossEntropyCriterionConfig):
    blockwise_loss: BLOCKWISE_LOSS_CHOICES = field(
        default="mean",
        metadata={"help": "mean: average the losses of all k heads; sample: one head per batch, drawn "
                          "uniformly among the heads that have trainable parameters (paper section 6); when "
                          "p_1 can change (fine-tuning), p_1's loss is added in every batch"},
    )
    blockwise_teacher_checkpoint: Optional[str] = field(
        default=None,
        metadata={"help": "fine-tuning: a frozen teacher (a fairseq transformer or blockwise checkpoint of the "
                          "same dictionaries, e.g. the baseline) whose distribution p_1 is pulled towards"},
    )
    blockwise_teacher_weight: float = field(
        default=1.0, metadata={"help": "weight of the KL(teacher || p_1) term per target token"},
    )
    blockwise_proposal_vocab: int = field(
        default=0,
        metadata={"help": "heads 2..k are trained over the first N target tokens only (the most frequent: fairseq "
                          "dictionaries list them first), as they propose with --block-proposal-vocab N when "
                          "decoding; a target outside them is left out of the loss and counts as a miss in the "
                          "accuracies. The heads' output products cost N/V of the full ones (0: all)"},
    )


@register_criterion("blockwise_label_smoothed_cross_entropy", dataclass=BlockwiseLabelSmoothedCrossEntropyConfig)
class BlockwiseLabelSmoothedCrossEntropyCriterion(LabelSmoothedCrossEntropyCriterion):
    def __init__(self, task, sentence_avg, label_smoothing, ignore_prefix_size=0, report_accuracy=False,
                 blockwise_loss="mean", blockwise_teacher_checkpoint=None, blockwise_teacher_weight=1.0,
                 blockwise_proposal_vocab=0):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        if ignore_prefix_size > 0:
            raise InputError("--ignore-prefix-size is not supported by blockwise_label_smoothed_cross_entropy")
        if blockwise_teacher_weight < 0:
            raise InputError(f"--blockwise-teacher-weight {blockwise_teacher_weight}: must be >= 0")
        special = task.target_dictionary.nspecial
        if blockwise_proposal_vocab and not special < blockwise_proposal_vocab <= len(task.target_dictionary):
            raise InputError(f"--blockwise-proposal-vocab {blockwise_proposal_vocab}: must be 0 (the whole "
                             f"vocabulary) or {special + 1}..{len(task.target_dictionary)}")
        self.blockwise_loss = blockwise_loss
        self.teacher_weight = blockwise_teacher_weight
        self.proposal_vocab = blockwise_proposal_vocab
        # A plain attribute holder, not a submodule: the teacher is neither trained nor saved with the model.
        self._teacher = [self._load_teacher(task, blockwise_teacher_checkpoint)] if blockwise_teacher_checkpoint else []

    @staticmethod
    def _load_teacher(task, path: str):
        from fairseq import checkpoint_utils, models

        flag = f"--blockwise-teacher-checkpoint {path}"
        try:
            state = checkpoint_utils.load_checkpoint_to_cpu(path)
        except FileNotFoundError:
            raise InputError(f"{flag}: no such file")
        cfg = state["cfg"]
        # The model registry, not task.build_model: the task would also set up its --eval-bleu generator
        # for this model, and the blockwise generator refuses a teacher without proposal heads.
        teacher = models.build_model(cfg.model, task, from_checkpoint=True)
        try:
            teacher.load_state_dict(state["model"], strict=True, model_cfg=cfg.model)
        except RuntimeError as error:
            raise InputError(f"{flag}: does not fit this task's dictionaries ({str(error).splitlines()[0]})")
        for parameter in teacher.parameters():
            parameter.requires_grad = False
        return teacher.eval()

    def _teacher_kl(self, model, sample, p1_lprobs, mask):
        """Sum over target tokens of KL(teacher || p_1)."""
        teacher = self._teacher[0]
        device = p1_lprobs.device
        if next(teacher.parameters()).device != device:
            teacher.to(device)
        with torch.no_grad():
            teacher_lprobs = utils.log_softmax(teacher(**sample["net_input"])[0].float(), dim=-1)
        kl = (teacher_lprobs.exp() * (teacher_lprobs - p1_lprobs.float())).sum(-1)
        return kl.masked_select(mask).sum()

    def heads_to_train(self, model):
        decoder = model.decoder
        if not hasattr(decoder, "proposal_heads"):
            raise InputError("--criterion blockwise_label_smoothed_cross_entropy needs --arch blockwise_transformer*")
        heads = list(range(decoder.num_proposal_heads))
        if not model.training:
            return heads
        base_trainable = any(p.requires_grad for name, p in model.named_parameters()
                             if not name.startswith("decoder.proposal_heads."))
        p1_trainable = decoder.proposal_heads.learned_first_head or base_trainable
        # Head 1 of a frozen base with p_1 = identity has nothing to train (its full-vocabulary product would
        # cost as much as a head's; validation scores it)
        trainable = [h for h in heads if h > 0 or p1_trainable]
        if self.blockwise_loss != "sample":
            return trainable or heads
        if p1_trainable and len(heads) > 1:  # p_1 in every batch, plus one of the proposal heads
            return [0, 1 + torch.randint(len(heads) - 1, (1,)).item()]
        return [trainable[torch.randint(len(trainable), (1,)).item()]]

    def forward(self, model, sample, reduce=True):
        features, _ = model(**sample["net_input"], features_only=True)
        target = sample["target"]
        total_loss, total_nll = 0.0, 0.0
        logging_output = {"ntokens": sample["ntokens"], "nsentences": target.size(0)}
        heads = self.heads_to_train(model)
        for head in heads:
            vocab = self.proposal_vocab if head > 0 else 0
            logits = model.decoder.project(model.decoder.proposal_heads(features, [head]).squeeze(-2), vocab)
            lprobs = utils.log_softmax(logits, dim=-1)
            # Head `head` (0-based) at position j predicts target[j + head].
            head_target = F.pad(target[:, head:], (0, head), value=self.padding_idx)
            mask = head_target.ne(self.padding_idx)
            # (outside a proposal vocabulary: no loss, and a miss below)
            trained = head_target.masked_fill(head_target >= vocab, self.padding_idx) if vocab else head_target
            loss, nll_loss = label_smoothed_nll_loss(
                lprobs.view(-1, lprobs.size(-1)), trained.reshape(-1), self.eps,
                ignore_index=self.padding_idx, reduce=reduce,
            )
            total_loss = total_loss + loss
            total_nll = total_nll + nll_loss
            n_correct = lprobs.argmax(-1).eq(head_target).masked_select(mask).sum()
            logging_output[f"head{head + 1}_nll_loss"] = nll_loss.data
            logging_output[f"head{head + 1}_n_correct"] = utils.item(n_correct.data)
            logging_output[f"head{head + 1}_total"] = utils.item(mask.sum().data)
            if head == 0 and self._teacher and self.teacher_weight > 0:
                kl = self._teacher_kl(model, sample, lprobs, mask)
                total_loss = total_loss + self.teacher_weight * kl * len(heads)  # not diluted by the head mean
                logging_output["teacher_kl"] = kl.data
        loss = total_loss / len(heads)
        nll_loss = total_nll / len(heads)
        sample_size = target.size(0) if self.sentence_avg else sample["ntokens"]
        every_proposal_head = set(range(1, model.decoder.num_proposal_heads)) <= set(heads)
        logging_output.update({"loss": loss.data, "nll_loss": nll_loss.data, "sample_size": sample_size,
                               "all_proposal_heads": int(every_proposal_head)})
        return loss, sample_size, logging_output

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        kl = sum(log.get("teacher_kl", 0) for log in logging_outputs)
        if any("teacher_kl" in log for log in logging_outputs):
            ntokens = sum(log.get("ntokens", 0) for log in logging_outputs)
            metrics.log_scalar("teacher_kl", kl / max(ntokens, 1) / math.log(2), ntokens, round=4)
        keys = {k for log in logging_outputs for k in log if k.startswith("head") and k.endswith("_total")}
        proposal_accuracies = []
        for key in sorted(keys, key=lambda k: int(k[4:-6])):
            head = key[: -len("_total")]
            total = utils.item(sum(log.get(key, 0) for log in logging_outputs))
            if total <= 0:
                continue
            nll = sum(log.get(f"{head}_nll_loss", 0) for log in logging_outputs)
            correct = utils.item(sum(log.get(f"{head}_n_correct", 0) for log in logging_outputs))
            metrics.log_scalar(f"{head}_nll_loss", nll / total / math.log(2), total, round=3)
            metrics.log_scalar(f"{head}_accuracy", 100.0 * correct / total, total, round=2)
            if head != "head1":
                proposal_accuracies.append(100.0 * correct / total)
        if proposal_accuracies and all(log.get("all_proposal_heads", 0) for log in logging_outputs):
            # Mean accuracy of heads 2..k (all scored: validation, or --blockwise-loss mean): what decides the
            # accepted block; a checkpoint metric (--best-checkpoint-metric proposal_accuracy
            # --maximize-best-checkpoint-metric).
            metrics.log_scalar("proposal_accuracy", sum(proposal_accuracies) / len(proposal_accuracies), 1, round=2)
