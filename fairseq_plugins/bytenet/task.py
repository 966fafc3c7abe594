"""``bytenet_translation``: stock translation plus a switch between cached and recomputed decoding.

A ByteNet checkpoint decodes with plain ``--task translation`` as well; this task exists so that
``fairseq-plugins bench --method bytenet`` can measure what the cache buys: ``--bytenet-decoding
recompute`` runs fairseq's own non-incremental path (the whole prefix through every layer at every
step), ``cached`` (the default) the incremental one, whose step runs a stack of ReLU blocks as one native call
where it can (``layers.DilatedStack.native_frame_steps``), and ``cached-torch`` the incremental one in torch
operations only (to time the native step against them).
"""

from dataclasses import dataclass, field

from fairseq.dataclass import ChoiceEnum
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from ..common.textio import InputError
from .model import ByteNetModel

DECODING_CHOICES = ChoiceEnum(["cached", "cached-torch", "recompute"])


@dataclass
class ByteNetTranslationConfig(TranslationConfig):
    bytenet_decoding: DECODING_CHOICES = field(
        default="cached",
        metadata={"help": "cached: each layer keeps its (k-1)*dilation past frames, O(layers) per token, a stack of "
                          "ReLU blocks stepped by one native call where the kernels build (float32 on the CPU); "
                          "cached-torch: the same in torch operations only; recompute: run the whole prefix through "
                          "the network at every step (the last two for comparison)"},
    )


@register_task("bytenet_translation", dataclass=ByteNetTranslationConfig)
class ByteNetTranslationTask(TranslationTask):
    cfg: ByteNetTranslationConfig

    def build_generator(self, models, args, **kwargs):
        if self.cfg.bytenet_decoding != "cached":
            others = [type(model).__name__ for model in models if not isinstance(model, ByteNetModel)]
            if others:
                raise InputError(f"--bytenet-decoding {self.cfg.bytenet_decoding} needs ByteNet models (--path), got "
                                 f"{', '.join(others)}")
        generator = super().build_generator(models, args, **kwargs)
        if self.cfg.bytenet_decoding == "recompute" and hasattr(generator, "model"):  # (--score-reference
            # scores with one full forward pass and has no steps.) SequenceGenerator then calls decoder.forward
            # on the whole prefix and keeps the last step.
            generator.model.has_incremental = False
        return generator

    def inference_step(self, generator, models, sample, prefix_tokens=None, constraints=None):
        if self.cfg.bytenet_decoding != "cached-torch":
            return super().inference_step(generator, models, sample, prefix_tokens, constraints)
        # For this call only: the bench's stock generator decodes the same model objects, natively.
        stacks = [model.decoder.stack for model in models]
        before = [stack.native_frame_steps for stack in stacks]
        try:
            for stack in stacks:
                stack.native_frame_steps = False
            return super().inference_step(generator, models, sample, prefix_tokens, constraints)
        finally:
            for stack, value in zip(stacks, before):
                stack.native_frame_steps = value
