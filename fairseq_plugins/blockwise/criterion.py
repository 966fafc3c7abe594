"""``blockwise_label_smoothed_cross_entropy``: label-smoothed cross entropy of every proposal head.

Head i (1-based) at decoder position j predicts target token j + i - 1, so its targets are the reference
shifted left by i - 1 (positions past the end are padding and ignored). The loss is the mean of the heads'
losses or, with ``--blockwise-loss sample``, the loss of one head drawn uniformly per batch (the paper's
unbiased estimate of that mean, which computes one head's logits instead of k). Validation always scores
every head. Each head's loss and accuracy are logged as ``head<i>_nll_loss`` and ``head<i>_accuracy``.
"""

import math
from dataclasses import dataclass, field

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

BLOCKWISE_LOSS_CHOICES = ChoiceEnum(["mean", "sample"])


@dataclass
class BlockwiseLabelSmoothedCrossEntropyConfig(LabelSmoothedCrossEntropyCriterionConfig):
    blockwise_loss: BLOCKWISE_LOSS_CHOICES = field(
        default="mean",
        metadata={"help": "mean: average the losses of all k heads; sample: one head per batch, drawn "
                          "uniformly among the heads that have trainable parameters (paper section 6)"},
    )


@register_criterion("blockwise_label_smoothed_cross_entropy", dataclass=BlockwiseLabelSmoothedCrossEntropyConfig)
class BlockwiseLabelSmoothedCrossEntropyCriterion(LabelSmoothedCrossEntropyCriterion):
    def __init__(self, task, sentence_avg, label_smoothing, ignore_prefix_size=0, report_accuracy=False,
                 blockwise_loss="mean"):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        if ignore_prefix_size > 0:
            raise ValueError("--ignore-prefix-size is not supported by blockwise_label_smoothed_cross_entropy")
        self.blockwise_loss = blockwise_loss

    def heads_to_train(self, model):
        decoder = model.decoder
        if not hasattr(decoder, "proposal_heads"):
            raise ValueError("--criterion blockwise_label_smoothed_cross_entropy needs --arch blockwise_transformer*")
        heads = list(range(decoder.num_proposal_heads))
        if not (model.training and self.blockwise_loss == "sample"):
            return heads
        base_trainable = any(p.requires_grad for name, p in model.named_parameters()
                             if not name.startswith("decoder.proposal_heads."))
        # Head 1 of a frozen base with p_1 = identity has nothing to train.
        trainable = [h for h in heads if h > 0 or decoder.proposal_heads.learned_first_head or base_trainable]
        return [trainable[torch.randint(len(trainable), (1,)).item()]]

    def forward(self, model, sample, reduce=True):
        features, _ = model(**sample["net_input"], features_only=True)
        target = sample["target"]
        total_loss, total_nll = 0.0, 0.0
        logging_output = {"ntokens": sample["ntokens"], "nsentences": target.size(0)}
        heads = self.heads_to_train(model)
        for head in heads:
            logits = model.decoder.head_logits(features, [head]).squeeze(-2)
            lprobs = utils.log_softmax(logits, dim=-1)
            # Head `head` (0-based) at position j predicts target[j + head].
            head_target = F.pad(target[:, head:], (0, head), value=self.padding_idx)
            loss, nll_loss = label_smoothed_nll_loss(
                lprobs.view(-1, lprobs.size(-1)), head_target.reshape(-1), self.eps,
                ignore_index=self.padding_idx, reduce=reduce,
            )
            total_loss = total_loss + loss
            total_nll = total_nll + nll_loss
            mask = head_target.ne(self.padding_idx)
            n_correct = lprobs.argmax(-1).eq(head_target).masked_select(mask).sum()
            logging_output[f"head{head + 1}_nll_loss"] = nll_loss.data
            logging_output[f"head{head + 1}_n_correct"] = utils.item(n_correct.data)
            logging_output[f"head{head + 1}_total"] = utils.item(mask.sum().data)
        loss = total_loss / len(heads)
        nll_loss = total_nll / len(heads)
        sample_size = target.size(0) if self.sentence_avg else sample["ntokens"]
        logging_output.update({"loss": loss.data, "nll_loss": nll_loss.data, "sample_size": sample_size})
        return loss, sample_size, logging_output

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        keys = {k for log in logging_outputs for k in log if k.startswith("head") and k.endswith("_total")}
        for key in sorted(keys, key=lambda k: int(k[4:-6])):
            head = key[: -len("_total")]
            total = utils.item(sum(log.get(key, 0) for log in logging_outputs))
            if total <= 0:
                continue
            nll = sum(log.get(f"{head}_nll_loss", 0) for log in logging_outputs)
            correct = utils.item(sum(log.get(f"{head}_n_correct", 0) for log in logging_outputs))
            metrics.log_scalar(f"{head}_nll_loss", nll / total / math.log(2), total, round=3)
            metrics.log_scalar(f"{head}_accuracy", 100.0 * correct / total, total, round=2)
