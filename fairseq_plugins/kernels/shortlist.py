"""Candidate lists (Devlin 2017; Marian's lexical shortlists) for any fairseq decoder: the softmax of a sentence
runs over the top-N translations of each of its source tokens plus the most frequent target tokens, not the
whole vocabulary (``output_layer.OutputLayer``, float32 or int8). Used by rnn_fc and the fast step.

``fairseq-plugins shortlist`` builds a ``Shortlist`` from an aligner's lexical table (``fairseq-plugins align
--lexical-table``, or fast_align's own ``-p`` file) and the data's dictionaries; the file records both
dictionaries' fingerprints and is refused with other ones. ``Shortlist.candidates`` gives a batch's lists.
"""

import logging
import math
import os
from collections import defaultdict
from typing import Dict, List, Tuple

import torch
from torch import Tensor

from ..common.dictionaries import check_dictionaries, dictionary_fingerprint, ids_by_count
from ..common.progress import progress_bar
from ..common.textio import InputError, atomic_output

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
NULL_WORD = "<eps>"  # fast_align's empty source word


def read_lexical_table(path: str, progress: bool = False) -> Dict[str, List[Tuple[float, str]]]:
    """source word -> [(ln p(target | source), target word)] from a fast_align ``-p`` style text table.
    ``progress``: a bar on stderr (a table has millions of lines)."""
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such lexical table")
    table: Dict[str, List[Tuple[float, str]]] = defaultdict(list)
    with open(path, encoding="utf-8") as f, \
            progress_bar(f, progress, desc="shortlist: reading the lexical table", unit="line") as lines:
        for number, line in enumerate(lines, start=1):
            fields = line.rstrip("\n").split("\t")
            if len(fields) != 3:
                raise InputError(f"{path}:{number}: expected 'source<TAB>target<TAB>log-probability', "
                                 f"got {len(fields)} field(s)")
            try:
                log_prob = float(fields[2])
            except ValueError:
                raise InputError(f"{path}:{number}: '{fields[2]}' is not a log-probability") from None
            if math.isnan(log_prob) or log_prob > 1e-6:
                raise InputError(f"{path}:{number}: {fields[2]} is not a log-probability (must be <= 0)")
            table[fields[0]].append((log_prob, fields[1]))
    if not table:
        raise InputError(f"{path}: empty lexical table")
    return table


class Shortlist:
    """Per source token id, its top translations (target ids, -1 padded); the frequent target ids; and the
    symbols every list holds (EOS, unknown)."""

    def __init__(self, translations: Tensor, frequent: Tensor, always: Tensor, source_fingerprint: str,
                 target_fingerprint: str, target_size: int, meta: Dict):
        self.translations, self.frequent, self.always = translations, frequent, always
        self.source_fingerprint, self.target_fingerprint = source_fingerprint, target_fingerprint
        self.target_size = target_size
        self.meta = meta

    @classmethod
    def build(cls, lexical_table: Dict[str, List[Tuple[float, str]]], src_dict, tgt_dict, top: int = 20,
              frequent: int = 100, source: str = "", progress: bool = False) -> "Shortlist":
        if top < 1:
            raise InputError(f"--top {top}: needs at least one translation per source word")
        if frequent < 0:
            raise InputError(f"--frequent {frequent}: must not be negative")
        translations = torch.full((len(src_dict), top), -1, dtype=torch.long)
        unknown_source = unknown_target = 0
        for source_word, entries in progress_bar(lexical_table.items(), progress, total=len(lexical_table),
                                                 desc="shortlist: lists", unit="word"):
            source_id = src_dict.index(source_word)
            if source_word == NULL_WORD or source_id == src_dict.unk():
                unknown_source += source_word != NULL_WORD
                continue
            ids = []
            # Best first; ties by target word so the list does not depend on the table's line order.
            for _, target_word in sorted(entries, key=lambda entry: (-entry[0], entry[1])):
                target_id = tgt_dict.index(target_word)
                if target_id == tgt_dict.unk() and target_word != tgt_dict.unk_word:
                    unknown_target += 1
                    continue
                ids.append(target_id)
                if len(ids) == top:
                    break
            translations[source_id, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        by_count = [i for i in ids_by_count(tgt_dict) if i >= tgt_dict.nspecial]
        frequent_ids = torch.tensor(sorted(by_count[:frequent]), dtype=torch.long)
        always = torch.tensor(sorted({tgt_dict.eos(), tgt_dict.unk()}), dtype=torch.long)
        meta = {"lexical_table": source, "top": top, "frequent": frequent,
                "source_words_in_table": len(lexical_table), "source_words_not_in_dictionary": unknown_source,
                "target_words_not_in_dictionary": unknown_target}
        return cls(translations, frequent_ids, always, dictionary_fingerprint(src_dict), dictionary_fingerprint(tgt_dict),
                   len(tgt_dict), meta)

    def save(self, path: str) -> None:
        state = {"format_version": FORMAT_VERSION, "translations": self.translations, "frequent": self.frequent,
                 "always": self.always, "source_dictionary": self.source_fingerprint,
                 "target_dictionary": self.target_fingerprint, "target_size": self.target_size, "meta": self.meta}
        with atomic_output(path, mode="wb") as f:
            torch.save(state, f)

    @classmethod
    def load(cls, path: str, src_dict=None, tgt_dict=None) -> "Shortlist":
        if not os.path.isfile(path):
            raise InputError(f"{path}: no such candidate list (build it with `fairseq-plugins shortlist`)")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file gets the same clear message
            raise InputError(f"{path}: not a candidate list file ({e})") from e
        if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
            raise InputError(f"{path}: not a candidate list file of format {FORMAT_VERSION}")
        sizes = {"source_dictionary_size": state["translations"].size(0), "target_dictionary_size": state["target_size"]}
        check_dictionaries(path, {**state, **sizes}, src_dict, tgt_dict, "rebuild it from this data")
        return cls(state["translations"], state["frequent"], state["always"], state["source_dictionary"],
                   state["target_dictionary"], state["target_size"], state["meta"])

    def to(self, device) -> "Shortlist":
        return Shortlist(self.translations.to(device), self.frequent.to(device), self.always.to(device),
                         self.source_fingerprint, self.target_fingerprint, self.target_size, self.meta)

    def membership(self, src_tokens: Tensor) -> Tensor:
        """(B, T) source ids -> (B, V) bool: which target ids each sentence's list holds."""
        batch = src_tokens.size(0)
        member = torch.zeros(batch, self.target_size + 1, dtype=torch.bool, device=src_tokens.device)
        member[:, self.frequent] = True
        member[:, self.always] = True
        translations = self.translations[src_tokens].view(batch, -1)  # (B, T * top); -1 pads
        # -1 (no translation) writes into the extra last column, dropped below.
        member.scatter_(1, torch.where(translations < 0, self.target_size, translations), True)
        return member[:, :self.target_size]

    def candidates(self, src_tokens: Tensor) -> Tuple[Tensor, Tensor]:
        """Each sentence's list as ascending target ids (B, C), padded to the longest list, and which entries
        are real (B, C) bool. (Source padding maps to its own row, whose translations are empty.)"""
        member = self.membership(src_tokens)
        sizes = member.sum(1)
        order = torch.sort(member.to(torch.uint8), dim=1, descending=True, stable=True).indices
        width = int(sizes.max())
        ids = order[:, :width]
        valid = torch.arange(width, device=ids.device).unsqueeze(0) < sizes.unsqueeze(1)
        return ids, valid

    def summary(self) -> str:
        held = (self.translations >= 0).sum(1)
        return (f"{int((held > 0).sum())} source words with translations (top {self.translations.size(1)}), "
                f"{self.frequent.numel()} frequent target words")


class TaskCandidateLists:
    """Mixin for a fairseq task with a candidate-list flag: ``shortlist()`` loads the file that
    ``candidate_lists_path()`` names once, checked against the task's dictionaries (None without the flag)."""

    _candidate_lists = None

    def candidate_lists_path(self) -> str:
        raise NotImplementedError

    def shortlist(self):
        path = self.candidate_lists_path()
        if not path:
            return None
        if self._candidate_lists is None:
            self._candidate_lists = Shortlist.load(path, self.source_dictionary, self.target_dictionary)
            logger.info("candidate lists %s: %s", path, self._candidate_lists.summary())
        return self._candidate_lists
