"""IBM-Model-2 candidate tables and the lattice they give (``fairseq-plugins lattice-table``).

From word alignments of the training data, count-based maximum likelihood without smoothing of

  P(y | x_a, a - t)   target token y given the aligned source token and the offset of its position,
  P(a | S, t)         the aligned source position given the source length S and target position t,

keeping the ``top_n`` most likely target tokens of each (x_a, a - t), and a least-squares line
|y| ~ slope * |x| + intercept for the target length. At inference

  P(y_t | x, t) = sum_a P(y_t | x_a, a - t) P(a | S, t)

and the lattice is its top K tokens at every position, computed for a whole batch with tensor operations
(sorted keys + searchsorted, a scatter-add into (batch, positions, vocabulary)) on the model's device.

Counting: positions are 1-based and exclude EOS. A target token aligned to n source positions adds 1/n to
each; an unaligned one takes the links of the nearest aligned target token (the left one on a tie); a
sentence without links counts the diagonal. Slots of a lattice the counts leave empty (unseen source words)
are filled with the most frequent target tokens (UNIGRAM_FILL). A context never seen in training (a (S, t) outside the counts)
backs off to the diagonal a = round(t * S / |y|-estimate). The file records the fingerprints of the
fairseq dictionaries it was built with; loading it with other dictionaries is an error.
"""

import logging
import os
from collections import defaultdict
from typing import Dict, List, Sequence, Tuple

import torch
from torch import Tensor

from ..common.dictionaries import check_dictionaries, dictionary_fingerprint
from ..common.progress import progress_bar
from ..common.textio import InputError, atomic_output
from ..tools.align import Alignment

logger = logging.getLogger(__name__)

TABLE_FORMAT = "fairseq-plugins lattice table"
TABLE_VERSION = 1
# Weight of the unigram distribution that fills lattice slots the counts leave empty: below any count-based
# probability (at least 1 / (training tokens) times an alignment weight), so it only breaks exact zeros.
UNIGRAM_FILL = 1e-9


def never_candidates(dictionary) -> List[int]:
    """Symbols that never enter a lattice: padding, BOS, and EOS (a path's end, not a lattice token)."""
    return sorted({dictionary.pad(), dictionary.bos(), dictionary.eos()})


def _spread_links(links: Alignment, source_length: int, target_length: int) -> List[List[int]]:
    """For each target position (0-based), the 0-based source positions it counts as aligned to."""
    aligned: List[List[int]] = [[] for _ in range(target_length)]
    for i, j in links:
        aligned[j].append(i)
    if not links:
        return [[min(source_length - 1, round(j * source_length / target_length))] for j in range(target_length)]
    has_links = [j for j in range(target_length) if aligned[j]]
    for j in range(target_length):
        if not aligned[j]:
            nearest = min(has_links, key=lambda k: (abs(k - j), k > j))
            aligned[j] = aligned[nearest]
    return aligned


class CandidateTable:
    """The two count tables and the length line, as tensors; ``lattice`` builds top-K lattices from it."""

    def __init__(self, state: Dict):
        self.state = state
        self.top_n = state["top_n"]
        self.max_offset = state["max_offset"]
        self.max_target_position = state["max_target_position"]
        self.lexical_keys: Tensor = state["lexical_keys"]
        self.lexical_tokens: Tensor = state["lexical_tokens"]
        self.lexical_probs: Tensor = state["lexical_probs"]
        self.alignment_keys: Tensor = state["alignment_keys"]
        self.alignment_probs: Tensor = state["alignment_probs"]
        self.length_slope = state["length_slope"]
        self.length_intercept = state["length_intercept"]
        self.unigram_probs: Tensor = state["unigram_probs"]

    # ---- building ---------------------------------------------------------------------------------
    @classmethod
    def build(cls, sources: Sequence[Sequence[int]], targets: Sequence[Sequence[int]],
              alignments: Sequence[Alignment], src_dict, tgt_dict, top_n: int = 40,
              alignment_path: str = "alignments", progress: bool = False) -> "CandidateTable":
        """Count the tables. ``sources``/``targets`` are token ids without EOS; links are 0-based (i, j).
        ``progress``: progress bars on stderr (a corpus of millions of pairs counts for minutes)."""
        if top_n < 1:
            raise InputError(f"--top-n {top_n}: keep at least one target token per context")
        if not (len(sources) == len(targets) == len(alignments)):
            raise InputError(f"{alignment_path} has {len(alignments)} lines for {len(sources)} sentence pairs")
        lexical: Dict[Tuple[int, int], Dict[int, float]] = defaultdict(lambda: defaultdict(float))
        positional: Dict[Tuple[int, int], Dict[int, float]] = defaultdict(lambda: defaultdict(float))
        lengths = []
        links_counted = 0
        # with: closed (the line cleared) on an error too, before its message
        with progress_bar(zip(sources, targets, alignments), progress, total=len(sources),
                          desc="lattice table: counting", unit="pair") as pairs:
            for number, (source, target, links) in enumerate(pairs, start=1):
                S, T = len(source), len(target)
                for i, j in links:
                    if i >= S or j >= T:
                        raise InputError(f"{alignment_path}:{number}: link {i}-{j} is outside the sentence pair "
                                         f"({S} source, {T} target tokens)")
                if S == 0 or T == 0:
                    continue
                lengths.append((S, T))
                for j, positions in enumerate(_spread_links(links, S, T)):
                    weight = 1.0 / len(positions)
                    t = j + 1
                    for i in positions:
                        a = i + 1
                        lexical[(source[i], a - t)][target[j]] += weight
                        positional[(S, t)][a] += weight
                        links_counted += 1
        if not lengths:
            raise InputError(f"{alignment_path}: no sentence pair with tokens on both sides")
        state = cls._tensors(lexical, positional, lengths, top_n, progress)
        unigram = torch.zeros(len(tgt_dict), dtype=torch.float64)
        for target in targets:
            unigram.index_add_(0, torch.tensor(target, dtype=torch.long), torch.ones(len(target), dtype=torch.float64))
        state["unigram_probs"] = (unigram / unigram.sum()).float()
        state.update(
            format=TABLE_FORMAT, version=TABLE_VERSION,
            source_dictionary=dictionary_fingerprint(src_dict), target_dictionary=dictionary_fingerprint(tgt_dict),
            source_dictionary_size=len(src_dict), target_dictionary_size=len(tgt_dict),
            sentences=len(lengths), links=links_counted,
        )
        return cls(state)

    @staticmethod
    def _tensors(lexical, positional, lengths, top_n, progress: bool = False) -> Dict:
        max_offset = max(abs(offset) for _, offset in lexical)
        span = 2 * max_offset + 1
        keys = sorted(lexical, key=lambda k: k[0] * span + k[1] + max_offset)
        lexical_tokens = torch.zeros(len(keys), top_n, dtype=torch.long)
        lexical_probs = torch.zeros(len(keys), top_n)
        for row, key in enumerate(progress_bar(keys, progress, desc="lattice table: top-n lists", unit="context")):
            counts = lexical[key]
            total = sum(counts.values())
            # Most frequent first; ties by token id, so the table is deterministic.
            best = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top_n]
            lexical_tokens[row, :len(best)] = torch.tensor([token for token, _ in best])
            lexical_probs[row, :len(best)] = torch.tensor([count / total for _, count in best])
        max_source = max(S for S, _ in positional)
        max_target_position = max(t for _, t in positional)
        alignment_keys = sorted(positional, key=lambda k: k[0] * (max_target_position + 1) + k[1])
        alignment_probs = torch.zeros(len(alignment_keys), max_source)
        for row, key in enumerate(alignment_keys):
            counts = positional[key]
            total = sum(counts.values())
            for a, count in counts.items():
                alignment_probs[row, a - 1] = count / total
        source_lengths = torch.tensor([S for S, _ in lengths], dtype=torch.float64)
        target_lengths = torch.tensor([T for _, T in lengths], dtype=torch.float64)
        slope, intercept = _least_squares(source_lengths, target_lengths)
        return dict(
            top_n=top_n, max_offset=max_offset, max_target_position=max_target_position,
            lexical_keys=torch.tensor([k[0] * span + k[1] + max_offset for k in keys], dtype=torch.long),
            lexical_tokens=lexical_tokens, lexical_probs=lexical_probs,
            alignment_keys=torch.tensor([S * (max_target_position + 1) + t for S, t in alignment_keys],
                                        dtype=torch.long),
            alignment_probs=alignment_probs, length_slope=slope, length_intercept=intercept,
        )

    # ---- files --------------------------------------------------------------------------------------
    def save(self, path: str) -> None:
        with atomic_output(path, mode="wb") as f:
            torch.save(self.state, f)

    @classmethod
    def load(cls, path: str, src_dict=None, tgt_dict=None) -> "CandidateTable":
        if not os.path.isfile(path):
            raise InputError(f"{path}: no such lattice table (build one with `fairseq-plugins lattice-table`)")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # a truncated or foreign file
            raise InputError(f"{path}: not a lattice table ({e.__class__.__name__}: {e})") from e
        if not isinstance(state, dict) or state.get("format") != TABLE_FORMAT:
            raise InputError(f"{path}: not a lattice table (built by `fairseq-plugins lattice-table`)")
        if state.get("version") != TABLE_VERSION:
            raise InputError(f"{path}: lattice table version {state.get('version')}; this fairseq-plugins reads "
                             f"version {TABLE_VERSION}: rebuild it with `fairseq-plugins lattice-table`")
        check_dictionaries(path, state, src_dict, tgt_dict, "rebuild the table from this data")
        return cls(state)

    def to(self, device) -> "CandidateTable":
        if self.lexical_keys.device != torch.device(device):
            state = {k: v.to(device) if torch.is_tensor(v) else v for k, v in self.state.items()}
            return CandidateTable(state)
        return self

    def summary(self) -> str:
        return (f"{self.state['sentences']} sentences, {len(self.lexical_keys)} (source token, offset) contexts "
                f"(top {self.top_n}), {len(self.alignment_keys)} (S, t) contexts, offsets within "
                f"+-{self.max_offset}, length {self.length_slope:.3f} * |x| + {self.length_intercept:.3f}")

    # ---- inference ---------------------------------------------------------------------------------
    def predicted_lengths(self, source_lengths: Tensor) -> Tensor:
        return (self.length_slope * source_lengths.double() + self.length_intercept).round().clamp(min=1).long()

    def alignment_weights(self, source_lengths: Tensor, target_lengths: Tensor, positions: int,
                          max_source: int) -> Tensor:
        """P(a | S, t): (batch, positions, max_source), t = 1..positions; unseen (S, t) -> the diagonal."""
        device = source_lengths.device
        t = torch.arange(1, positions + 1, device=device)
        S = source_lengths.unsqueeze(1)
        keys = S * (self.max_target_position + 1) + t.unsqueeze(0)
        row = torch.searchsorted(self.alignment_keys, keys).clamp(max=len(self.alignment_keys) - 1)
        found = (self.alignment_keys[row] == keys) & (t.unsqueeze(0) <= self.max_target_position)
        width = self.alignment_probs.size(1)
        weights = self.alignment_probs[row]  # (batch, positions, width)
        if width < max_source:
            weights = torch.nn.functional.pad(weights, (0, max_source - width))
        weights = weights[:, :, :max_source] * found.unsqueeze(-1)
        diagonal = ((t.unsqueeze(0) * S).double() / target_lengths.unsqueeze(1).double()).round().long()
        diagonal = torch.minimum(diagonal, S).clamp(min=1) - 1  # 0-based; an empty source points at slot 0
        backoff = torch.nn.functional.one_hot(diagonal, max_source).to(weights)
        return torch.where(found.unsqueeze(-1), weights, backoff)

    def position_distributions(self, source: Tensor, source_lengths: Tensor, target_lengths: Tensor,
                               positions: int, vocabulary: int) -> Tensor:
        """P(y_t | x, t) for t = 1..positions: (batch, positions, vocabulary).

        ``source`` is (batch, max_source) token ids, right-padded, without EOS."""
        batch, max_source = source.shape
        device = source.device
        weights = self.alignment_weights(source_lengths, target_lengths, positions, max_source)
        t = torch.arange(1, positions + 1, device=device).view(1, positions, 1)
        a = torch.arange(1, max_source + 1, device=device).view(1, 1, max_source)
        offset = a - t  # (1, positions, max_source)
        span = 2 * self.max_offset + 1
        keys = source.unsqueeze(1) * span + (offset + self.max_offset)
        usable = (offset.abs() <= self.max_offset) & (a <= source_lengths.view(batch, 1, 1))
        row = torch.searchsorted(self.lexical_keys, keys.reshape(-1)).clamp(max=len(self.lexical_keys) - 1)
        found = usable & (self.lexical_keys.index_select(0, row).view(keys.shape) == keys)
        top_n = self.lexical_probs.size(1)
        # (batch, positions, max_source, top_n); index_select rather than indexing: faster on the CPU
        mass = self.lexical_probs.index_select(0, row).view(*keys.shape, top_n) * (weights * found).unsqueeze(-1)
        tokens = self.lexical_tokens.index_select(0, row).view(*keys.shape, top_n)
        dense = torch.zeros(batch, positions, vocabulary, device=device, dtype=mass.dtype)
        dense.scatter_add_(2, tokens.reshape(batch, positions, -1), mass.reshape(batch, positions, -1))
        return dense

    def fill_with_frequent(self, dense: Tensor) -> Tensor:
        """Add UNIGRAM_FILL x P(y): the counts' candidates keep their order (their mass is far larger), and
        the slots they leave empty (unseen source words, few candidates) go to the most frequent tokens."""
        return dense + UNIGRAM_FILL * self.unigram_probs.to(dense)

    def lattice(self, source: Tensor, source_lengths: Tensor, target_lengths: Tensor, positions: int, k: int,
                vocabulary: int, excluded: Sequence[int] = (), mass: float = 1.0) -> Tuple[Tensor, Tensor]:
        """Top-``k`` tokens of P(y_t | x, t) at t = 1..positions: (tokens, probs), each (batch, positions, k),
        most likely first. ``excluded`` ids (special symbols) never enter; a slot with probability 0 (fewer
        than k tokens with any mass, or past ``mass``) holds an arbitrary token and must be treated as absent.
        ``mass`` < 1 keeps, at each position, only the most likely candidates needed to reach that share of the
        position's whole table mass (at least one, at most k): an adaptive K."""
        dense = self.position_distributions(source, source_lengths, target_lengths, positions, vocabulary)
        dense = self.fill_with_frequent(dense)
        if excluded:
            dense[:, :, list(excluded)] = -1.0
        probs, tokens = dense.topk(min(k, vocabulary), dim=-1)
        probs = probs.clamp(min=0)
        if mass < 1.0:
            probs = probs * within_mass(probs, dense.clamp(min=0).sum(dim=-1), mass)
        return tokens, probs


def within_mass(probs: Tensor, totals: Tensor, mass: float) -> Tensor:
    """Which of each position's candidates (``probs`` (..., k), most likely first) are needed to reach ``mass``
    of the position's total probability ``totals`` (...): a candidate is kept while the ones before it hold
    less than that, so the first always is."""
    before = probs.cumsum(dim=-1) - probs
    return before < mass * totals.unsqueeze(-1)


def _least_squares(x: Tensor, y: Tensor) -> Tuple[float, float]:
    if len(x) < 2 or float(x.var()) == 0.0:
        return 0.0, float(y.mean())
    slope = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())
    return slope, float(y.mean() - slope * x.mean())


def read_binarized_pairs(data_bin: str, split: str, source_lang: str, target_lang: str):
    """(source ids, target ids, src_dict, tgt_dict) of a fairseq-preprocess'd split, EOS removed."""
    from fairseq.data import Dictionary, data_utils

    dictionaries = []
    for lang in (source_lang, target_lang):
        path = os.path.join(data_bin, f"dict.{lang}.txt")
        if not os.path.isfile(path):
            raise InputError(f"{path}: no such dictionary (is {data_bin} fairseq-preprocess output?)")
        dictionaries.append(Dictionary.load(path))
    sides = []
    for lang, dictionary in zip((source_lang, target_lang), dictionaries):
        prefix = os.path.join(data_bin, f"{split}.{source_lang}-{target_lang}.{lang}")
        dataset = data_utils.load_indexed_dataset(prefix, dictionary)
        if dataset is None:
            raise InputError(f"{prefix}.bin: no such binarised split")
        eos = dictionary.eos()
        sides.append([_strip_eos(dataset[i].tolist(), eos) for i in range(len(dataset))])
    return sides[0], sides[1], dictionaries[0], dictionaries[1]


def _strip_eos(ids: List[int], eos: int) -> List[int]:
    return ids[:-1] if ids and ids[-1] == eos else ids


def lattice_recall(table: CandidateTable, sources: Sequence[Sequence[int]], targets: Sequence[Sequence[int]],
                   ks: Sequence[int], vocabulary: int, excluded: Sequence[int] = (),
                   batch_size: int = 64, progress: bool = False) -> Dict[int, float]:
    """Share of reference tokens that are among the top-k candidates of their position (paper Fig. 1),
    with the reference length as the length the lattice is built for. ``progress``: a bar on stderr."""
    hits = {k: 0 for k in ks}
    total = 0
    biggest = max(ks)
    for start in progress_bar(range(0, len(sources), batch_size), progress, desc="lattice recall", unit="batch"):
        chunk = [(s, t) for s, t in zip(sources[start:start + batch_size], targets[start:start + batch_size])
                 if s and t]
        if not chunk:
            continue
        source, source_lengths = _pad_batch([s for s, _ in chunk])
        reference, reference_lengths = _pad_batch([t for _, t in chunk])
        tokens, probs = table.lattice(source, source_lengths, reference_lengths, reference.size(1), biggest,
                                      vocabulary, excluded)
        present = (tokens == reference.unsqueeze(-1)) & (probs > 0)  # (batch, positions, biggest)
        real = torch.arange(reference.size(1)).unsqueeze(0) < reference_lengths.unsqueeze(1)
        for k in ks:
            hits[k] += int((present[:, :, :k].any(-1) & real).sum())
        total += int(reference_lengths.sum())
    return {k: hits[k] / max(total, 1) for k in ks}


def _pad_batch(sequences: Sequence[Sequence[int]], pad: int = 1) -> Tuple[Tensor, Tensor]:
    lengths = torch.tensor([len(s) for s in sequences])
    batch = torch.full((len(sequences), int(lengths.max())), pad, dtype=torch.long)
    for row, s in enumerate(sequences):
        batch[row, :len(s)] = torch.tensor(s, dtype=torch.long)
    return batch, lengths
