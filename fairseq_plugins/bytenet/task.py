"""``bytenet_translation``: stock translation plus a switch between cached and recomputed decoding.

A ByteNet checkpoint decodes with plain ``--task translation`` as well; this task exists so that
``fairseq-plugins bench --method bytenet`` can measure what the cache buys: ``--bytenet-decoding
recompute`` runs fairseq's own non-incremental path (the whole prefix through every layer at every
step), ``cached`` (the default) the incremental one.
"""

from dataclasses import dataclass, field

from fairseq.dataclass import ChoiceEnum
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from .model import ByteNetModel

DECODING_CHOICES = ChoiceEnum(["cached", "recompute"])


@dataclass
class ByteNetTranslationConfig(TranslationConfig):
    bytenet_decoding: DECODING_CHOICES = field(
        default="cached",
        metadata={"help": "cached: each layer keeps its (k-1)*dilation past frames, O(layers) per token; "
                          "recompute: run the whole prefix through the network at every step (for comparison)"},
    )


@register_task("bytenet_translation", dataclass=ByteNetTranslationConfig)
class ByteNetTranslationTask(TranslationTask):
    cfg: ByteNetTranslationConfig

    def build_generator(self, models, args, **kwargs):
        if self.cfg.bytenet_decoding == "recompute":
            others = [type(model).__name__ for model in models if not isinstance(model, ByteNetModel)]
            if others:
                raise ValueError(f"--bytenet-decoding recompute needs ByteNet models (--path), got {', '.join(others)}")
        generator = super().build_generator(models, args, **kwargs)
        if self.cfg.bytenet_decoding == "recompute" and hasattr(generator, "model"):  # (--score-reference
            # scores with one full forward pass and has no steps.) SequenceGenerator then calls decoder.forward
            # on the whole prefix and keeps the last step.
            generator.model.has_incremental = False
        return generator
