"""Targets in the order the decoder produces them, and back (Imamura & Sumita 2020, section 3).

``--token-order`` / ``--tokens-per-step`` (y1..yn is a sentence without its EOS):

  l2r   1   y1 y2 ... yn EOS                      fairseq's own order
  r2l   1   yn ... y2 y1 EOS
  l2r   2   (y1 y2) (y3 y4) ... (.. EOD)          two contiguous tokens a step
  r2l   2   (yn yn-1) ... (.. EOD)
  bidir 2   (y1 yn) (y2 yn-1) ... (.. EOD)        left half L2R in the first slot, right half R2L in the second

With two tokens a step the sentence ends with an end-of-decoding symbol (EOD) instead of EOS, and one or
two EODs make the count even, so the last pair always holds one: an odd n gets one EOD (bidir: the middle
token y_ceil(n/2) and EOD), an even n two (EOD EOD). ``fold`` and ``unfold`` are exact inverses on these
sequences; ``unfold`` also reads any decoded sequence (an EOD in either slot, or none at all).
"""

from typing import List, Sequence

import torch

from fairseq.data import BaseWrapperDataset, data_utils

from ..common.textio import InputError

EOD_SYMBOL = "<eod>"
TOKEN_ORDERS = ("bidir", "l2r", "r2l")


def check_token_order(token_order: str, tokens_per_step: int) -> None:
    if token_order not in TOKEN_ORDERS:
        raise InputError(f"--token-order {token_order}: must be one of {', '.join(TOKEN_ORDERS)}")
    if tokens_per_step not in (1, 2):
        raise InputError(f"--tokens-per-step {tokens_per_step}: must be 1 or 2")
    if token_order == "bidir" and tokens_per_step != 2:
        raise InputError("--token-order bidir needs --tokens-per-step 2 (one token from each end per step)")


def fold(tokens: Sequence[int], token_order: str, tokens_per_step: int, eod: int) -> List[int]:
    """Natural-order tokens (no EOS) -> decoding order; with two tokens a step, EOD-terminated and even."""
    tokens = list(tokens)
    if tokens_per_step == 1:
        return tokens if token_order == "l2r" else tokens[::-1]
    n = len(tokens)
    pairs = n // 2 + 1  # the last pair holds the EOD(s)
    if token_order == "bidir":
        half = (n + 1) // 2  # the left half takes the middle token of an odd sentence
        left = tokens[:half] + [eod] * (pairs - half)
        right = tokens[half:][::-1] + [eod] * (pairs - (n - half))
        return [token for pair in zip(left, right) for token in pair]
    ordered = tokens if token_order == "l2r" else tokens[::-1]
    return ordered + [eod] * (2 * pairs - n)


def unfold_indices(folded: Sequence[int], token_order: str, tokens_per_step: int, eod: int) -> List[int]:
    """Indices into ``folded`` of its real tokens, in natural order (what ``unfold`` keeps).

    Single-order sequences end at their first EOD. A bidirectional one ends with the first pair that holds
    an EOD: that pair's other token, if real, is the middle of the sentence.
    """
    if tokens_per_step == 1 or token_order != "bidir":
        end = next((i for i, token in enumerate(folded) if token == eod), len(folded))
        kept = list(range(end))
        return kept if token_order == "l2r" else kept[::-1]
    left, right = [], []
    for i in range(0, len(folded), 2):
        pair = range(i, min(i + 2, len(folded)))
        for slot, j in enumerate(pair):
            if folded[j] != eod:
                (left if slot == 0 else right).append(j)
        if any(folded[j] == eod for j in pair):
            break
    return left + right[::-1]


def unfold(folded: Sequence[int], token_order: str, tokens_per_step: int, eod: int) -> List[int]:
    """Decoding order -> natural-order tokens (inverse of ``fold``)."""
    folded = list(folded)
    return [folded[i] for i in unfold_indices(folded, token_order, tokens_per_step, eod)]


class FoldedTargetDataset(BaseWrapperDataset):
    """A language-pair dataset whose batches also carry the folded target.

    ``target`` stays in natural order (what fairseq-generate prints and scores); ``folded_target`` and
    ``folded_ntokens`` are what the model is trained on, and ``net_input["prev_output_tokens"]`` is the folded
    target shifted by one step: EOS (the start symbol) then the target without its last token, or with two
    tokens a step, two start symbols then the target without its last pair.
    """

    def __init__(self, dataset, token_order: str, tokens_per_step: int, eos: int, eod: int):
        super().__init__(dataset)
        check_token_order(token_order, tokens_per_step)
        self.token_order, self.tokens_per_step = token_order, tokens_per_step
        self.eos, self.eod = eos, eod
        self.pad = dataset.tgt_dict.pad()

    def fold_target(self, target: torch.Tensor) -> torch.Tensor:
        tokens = target.tolist()
        if tokens and tokens[-1] == self.eos:
            tokens = tokens[:-1]
        folded = fold(tokens, self.token_order, self.tokens_per_step, self.eod)
        if self.tokens_per_step == 1:
            folded.append(self.eos)
        return target.new_tensor(folded)

    def __getitem__(self, index):
        item = self.dataset[index]
        if item.get("target") is not None:
            item["folded_target"] = self.fold_target(item["target"])
        return item

    def collater(self, samples):
        batch = self.dataset.collater(samples)
        if not batch or batch.get("target") is None:
            return batch
        by_id = {int(sample["id"]): sample["folded_target"] for sample in samples}
        folded = [by_id[int(i)] for i in batch["id"]]  # the wrapped collater sorts the batch
        left_pad = self.dataset.left_pad_target
        batch["folded_target"] = data_utils.collate_tokens(folded, self.pad, self.eos, left_pad)
        batch["folded_ntokens"] = sum(len(f) for f in folded)
        if self.tokens_per_step == 1:
            prev = data_utils.collate_tokens(folded, self.pad, self.eos, left_pad, move_eos_to_beginning=True)
        else:
            start = folded[0].new_full((2,), self.eos)
            prev = data_utils.collate_tokens([torch.cat([start, f[:-2]]) for f in folded], self.pad, self.eos,
                                             left_pad)
        batch["net_input"]["prev_output_tokens"] = prev
        return batch
