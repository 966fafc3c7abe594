"""Blockwise parallel decoding on the fast decoder step (``--task blockwise_translation --fast-step``).

The same predict-verify-accept loop as ``BlockwiseGenerator``; its model calls run on ``FastDecoderStep``:
a block of proposals goes through each decoder layer as the rows of one product (``block_step``: each weight
read once for the block, all sentences of the batch together), the rejected tail is taken back by
``keep_block`` (at batch 1 the cache's end moves back; in a batch each sentence keeps its own number of
positions, the rest masked), p_1 is projected at every fed position, the heads only at the last accepted one
(found by verification first), and the heads and output products use the step's precision (float32 or int8
with per-row activation scales).

With exact acceptance and float32 the output is greedy decoding's (that of the blockwise model's base),
as on fairseq's decoder. ``static_step`` (``cuda_graphs``: --fast-step-cuda-graphs, each call captured as a CUDA
graph) runs the decoder calls on ``StaticDecoderStep``: a block's call has one shape for the whole batch, each
row's prefix its own length on the device.
"""

import math
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels import native
from ..kernels.decoder_step import fast_step_parts, native_matrix
from ..kernels.precision import linear_of
from ..kernels.static_step import StaticDecoderStep
from .generator import BlockwiseGenerator
from .model import ProposalHeads, row_blocks


class FastProposalHeads:
    """Some proposal heads of a ``ProposalHeads`` (head 0 is p_1) as fast-step matrices: features (m, d) ->
    head states (m, len(heads), d), as ``ProposalHeads.forward(x, heads)`` in evaluation mode. Only the weights
    of those heads are read (the joint layout's shared hidden layer excepted)."""

    def __init__(self, heads: ProposalHeads, indices: Sequence[int], precision: str):
        self.count = len(indices)
        self.layout = heads.layout
        # (position in the output, learned head) of each head that is not the identity
        learned = [(i, h if heads.learned_first_head else h - 1) for i, h in enumerate(indices)]
        self.slots = [i for i, j in learned if j >= 0]
        self.learned = [j for _i, j in learned if j >= 0]
        d, h = heads.embed_dim, heads.ffn_dim
        self.hidden_size = h
        self.fc1, self.fc2 = None, []
        if not self.learned:
            return
        if heads.layout == "joint":  # one hidden layer for all heads; the needed heads' output rows
            self.fc1 = linear_of(heads.fc1.weight, heads.fc1.bias, precision)
            self.fc2 = [linear_of(row_blocks(heads.fc2.weight, self.learned, d),
                                  row_blocks(heads.fc2.bias, self.learned, d), precision)]
        else:  # the needed heads' hidden layers in one product, their output layers one each
            self.fc1 = linear_of(row_blocks(heads.fc1.weight, self.learned, h),
                                 row_blocks(heads.fc1.bias, self.learned, h), precision)
            self.fc2 = [linear_of(heads.fc2_weight[j], heads.fc2_bias[j], precision) for j in self.learned]

    def native(self, projection) -> "Optional[native.ProposalHeads]":
        """These heads (all learned) and ``projection`` (a ``linear_of`` product, or a native matrix) as the
        native kernels' struct for ``fp_blockwise_search``, or None where a part is not native."""
        if not self.learned or len(self.slots) != self.count:
            return None
        fc1 = native_matrix(self.fc1)
        fc2 = [native_matrix(fc2) for fc2 in self.fc2]
        if not isinstance(projection, native.Matrix):
            projection = native_matrix(projection)
        if fc1 is None or projection is None or any(matrix is None for matrix in fc2):
            return None
        offsets = [0] if self.layout == "joint" else [j * self.hidden_size for j in range(len(fc2))]
        return native.proposal_heads(fc1, fc2, offsets, self.count, projection)

    def __call__(self, x: Tensor) -> Tensor:
        states = [x] * self.count
        if self.learned:
            hidden = F.relu(self.fc1(x))
            if self.layout == "joint":
                deltas = self.fc2[0](hidden).view(x.size(0), len(self.learned), -1).unbind(1)
            else:
                parts = hidden.view(x.size(0), len(self.learned), self.hidden_size).unbind(1)
                deltas = [fc2(part.contiguous()) for fc2, part in zip(self.fc2, parts)]
            for slot, delta in zip(self.slots, deltas):
                states[slot] = x + delta
        return torch.stack(states, dim=1)


# From this many sentences on, p_1 verifies a block one position at a time, each product only over the sentences
# whose proposals were all accepted so far. At batch 1 a product costs its weight reading, so one product for the
# whole block is cheaper; at a few dozen sentences it costs its arithmetic (on the baseline's shapes the 8k x 256
# output layer is 2.0M multiply-adds a row, its three decoder layers 2.8M), and the rows after a sentence's first
# rejection would be wasted.
STAGED_VERIFICATION_MIN_SENTENCES = 16


class FastStepBlockwiseGenerator(BlockwiseGenerator):
    """``BlockwiseGenerator`` whose model calls run on the fast decoder step."""

    step_backend = "fast step"

    def __init__(self, model, tgt_dict, block_size: int, precision: str = "fp32",
                 staged_verification_min_sentences: int = STAGED_VERIFICATION_MIN_SENTENCES,
                 static_step: bool = False, cuda_graphs: bool = False, **kwargs):
        super().__init__(model, tgt_dict, block_size, **kwargs)
        self.precision = precision
        self.staged_verification_min_sentences = staged_verification_min_sentences
        self.engine, self.encoder = fast_step_parts(model, precision, features_only=True)
        # What runs the decoder calls: the engine, or the static step on its weights (the output products stay
        # the engine's, outside a captured call)
        self.steps = self.engine
        if static_step or cuda_graphs:
            self.steps = StaticDecoderStep(self.engine, cuda_graphs)
        # p_1 verifies at every fed position; heads 2..k run at the last accepted position only, once
        # verification has found it (at batch 1 a product's cost grows with its rows)
        heads = model.decoder.proposal_heads
        self.first_head = FastProposalHeads(heads, [0], precision)
        self.proposal_heads = FastProposalHeads(heads, range(1, block_size), precision)
        self.vocab_size = len(tgt_dict)
        # Heads 2..k propose over the first ``proposal_vocab`` entries (a product of its own, once a call); p_1
        # verifies over all of them
        projection, vocab = model.decoder.output_projection, self.proposal_vocab
        self.proposal_projection = None
        if vocab and block_size > 1:
            self.proposal_projection = linear_of(projection.weight[:vocab], None if projection.bias is None
                                                 else projection.bias[:vocab], precision)

        # One sentence's whole decoding in one native call (exact acceptance, batch 1; tests/test_blockwise.py)
        self.native_heads = None
        if (self.engine.native_decoder is not None and not heads.learned_first_head and block_size > 1
                and self.steps is self.engine):
            self.native_heads = self.proposal_heads.native(
                self.engine.native_decoder.output if self.proposal_projection is None else self.proposal_projection)

    def generation_stats(self) -> Dict:
        return {**super().generation_stats(), "fast_step": True, "precision": self.precision,
                "static_step": self.steps is not self.engine,
                "cuda_graphs": getattr(self.steps, "cuda_graphs", False)}

    @torch.no_grad()
    def generate(self, models, sample, prefix_tokens=None, constraints=None, bos_token=None, **kwargs):
        hypotheses = self._native_generate(sample, prefix_tokens, constraints, bos_token)
        if hypotheses is None:
            return super().generate(models, sample, prefix_tokens, constraints, bos_token, **kwargs)
        return hypotheses

    def _native_generate(self, sample, prefix_tokens, constraints, bos_token):
        """The predict-verify-accept loop of ``BlockwiseGenerator.generate`` in one native call
        (``fp_blockwise_search``), where it applies: one sentence, exact acceptance, no adaptive blocks or
        forced block sizes, temperature 1, p_1 the decoder itself; None elsewhere."""
        src_tokens = sample["net_input"]["src_tokens"]
        if (self.native_heads is None or src_tokens.size(0) != 1 or self.acceptance != "exact"
                or self.adaptive_threshold or self.min_block_size > 1 or self.temperature != 1.0):
            return None
        self._begin_generate(prefix_tokens, constraints)
        max_len = self.rules.max_len(src_tokens.size(1), self.max_positions - 1)
        self._begin(self._encode(sample["net_input"]), max_len)
        rules = self.rules
        found = self.engine.blockwise_search(self.native_heads, self.eos if bos_token is None else bos_token,
                                             self.eos, self.pad, rules.unk, rules.unk_penalty, rules.min_len, max_len)
        if found is None:
            return None
        tokens, scores, (iterations, passes) = found
        self._stats["batches"] += 1
        self._stats["iterations"] += iterations
        self._stats["decoder_invocations"] += passes
        self._stats["block_tokens_fed"] += (passes - 1) * self.block_size
        self._stats["blocks_fed"] += passes - 1
        return [self._hypothesis(tokens, scores)]

    def step_cost_figures(self, samples, **kwargs) -> Dict:
        # A timed call verifies every position: what staging saves depends on what is accepted, and the timed
        # blocks (one token repeated) say nothing about that
        staged, self.staged_verification_min_sentences = self.staged_verification_min_sentences, math.inf
        try:
            return {**super().step_cost_figures(samples, **kwargs), "call_cost_staged_verification": False}
        finally:
            self.staged_verification_min_sentences = staged

    # --- the model's side on the fast step ---------------------------------------------------------------

    def _encode(self, net_input):
        return self.encoder.forward_torchscript(net_input)

    def _begin(self, encoder_out, max_len: int) -> None:
        # (a block may run block_size - 1 positions past the last accepted token)
        self.steps.start(encoder_out, max_steps=max_len + self.block_size + 2)

    def _block_features(self, block: Tensor, positions: Tensor, encoder_out, state) -> Tensor:
        # (the engine keeps each row's position itself: ``positions`` are the same numbers)
        return self.steps.block_step(block).view(block.size(0), block.size(1), -1)

    def _verify_call(self, block: Tensor, cached: Tensor, generated: Tensor, encoder_out, incremental_state,
                     max_len: int) -> Tuple[Tensor, Tensor, Tensor]:
        """As ``BlockwiseGenerator._verify_call``; from ``staged_verification_min_sentences`` sentences on, p_1's
        output product runs position by position over the sentences still accepting, and the positions after a
        sentence's first rejection keep -inf logits, which no acceptance rule accepts (nothing after them is
        read: a sentence's accepted tokens, its scores and its next p_1 row all lie before)."""
        rows, m = block.shape
        if rows < self.staged_verification_min_sentences or m == 1:
            return super()._verify_call(block, cached, generated, encoder_out, incremental_state, max_len)
        features = self._block_features(block, None, encoder_out, incremental_state)
        self._stats["decoder_invocations"] += 1
        base = features.new_full((rows, m, self.vocab_size), -math.inf, dtype=torch.float32)
        lse = features.new_zeros(rows, m, dtype=torch.float32)
        live = torch.arange(rows, device=block.device)
        for i in range(m):
            logits = self.engine.logits(self.first_head(features[live, i])[:, 0])
            row_base, row_lse = self._first_head_scores(logits, generated[live] + 1 + i, max_len)
            base[live, i], lse[live, i] = row_base, row_lse
            if i + 1 == m:
                break
            proposed = block[live, i + 1].unsqueeze(1)
            scores = row_base.gather(1, proposed) - row_lse.unsqueeze(1)
            live = live[self._verified(proposed, row_base.unsqueeze(1), scores, first=i)[:, 0]]
            if live.numel() == 0:
                break
        return base, lse, features

    def _block_logits(self, features: Tensor) -> Tuple[Tensor, Tensor]:
        """p_1's logits (B, m, V) at every position, and the features, from which ``_heads_logits_at`` proposes."""
        rows, m, dim = features.shape
        return self.engine.logits(self.first_head(features.view(-1, dim))[:, 0]).view(rows, m, -1), features

    def _heads_logits_at(self, features: Tensor, row_index: Tensor, last: Tensor) -> Tensor:
        """Heads 2..k's logits (B, k - 1, V') at each row's last accepted position: one feature row a sentence
        through the heads, then one product over the proposal vocabulary (or the output layer)."""
        if self.block_size == 1:
            return features.new_zeros(row_index.numel(), 0, self.vocab_size)
        states = self.proposal_heads(features[row_index, last])  # (B, k - 1, d)
        rows = states.reshape(-1, states.size(-1))
        if self.proposal_projection is None:
            return self.engine.logits(rows).view(row_index.numel(), self.block_size - 1, -1)
        return self.proposal_projection(rows).view(row_index.numel(), self.block_size - 1, -1)

    def _cached_length(self, state) -> int:
        return self.steps.length

    def _rollback(self, state, cached: Tensor, accepted: Tensor, physical: int) -> None:
        self.steps.keep_block(physical, accepted)

    def _truncate(self, state, length: int) -> None:
        self.steps.truncate(length)

    def _greedy_step(self, tokens: Tensor, encoder_out, state) -> Tensor:
        logits = self.engine.logits(self.steps.group_step(tokens[:, -1:]))
        return torch.log_softmax(logits.float(), dim=-1).argmax(dim=-1)

    def _keep_rows(self, keep: Tensor, state, encoder_out):
        # The engine holds the sources' keys and values; fairseq's encoder output is not read again
        self.steps.reorder(keep)
        return encoder_out
