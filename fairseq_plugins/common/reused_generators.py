"""A task's generators reused across ``build_generator`` calls with the same models and settings (registers
nothing).

fairseq's hub interface builds a new generator on every ``hub.translate``/``hub.generate`` call. For a fast
generator that set-up is a large share of a sentence: on the baseline, fairseq's ``build_generator`` and the fast
step's generator took 0.6 ms a call against 4.6 ms for a whole int8 greedy sentence, and a new generator's
freshly allocated caches are touched for the first time inside the timed search. A task with this mixin builds a
generator once per (thread, models, their parameters, every generation setting) and hands the same one out again.

What keeps it exact: the key holds the whole generation config (its text: every flag and value), the models'
identities and their parameters' fingerprint (a model trained or loaded again gets a new generator), and the
thread (a generator carries per-call state, so two threads never share one). A caller that passes its own
generator class or constructor arguments always gets a new generator, as it would from fairseq.
"""

import functools
import threading
from collections import OrderedDict
from typing import Callable, Hashable


def generation_settings_key(args) -> Hashable:
    """Every generation setting of ``args`` as one hashable value: the text of an omegaconf config (12 us for
    fairseq's 44 generation fields, where a deep copy takes 700 us), the sorted items of a Namespace."""
    from omegaconf import DictConfig

    if isinstance(args, DictConfig):
        return str(args)
    return repr(sorted(vars(args).items()))


class ReusedGenerators:
    """Mixin for a task: ``reused_generator`` returns the generator built earlier for the same call, or builds
    one. At most ``max_reused_generators`` are kept (the least recently used is dropped)."""

    max_reused_generators = 8

    def reused_generator(self, models, args, build: Callable[[], object], *, seq_gen_cls=None,
                         extra_gen_cls_kwargs=None, prefix_allowed_tokens_fn=None,
                         fingerprint: Hashable = None):
        """``build()``'s generator, or the one it built for an equal call before. ``fingerprint``: what must also
        be unchanged (the models' parameters, for a generator holding copies of their weights)."""
        if seq_gen_cls is not None or extra_gen_cls_kwargs:
            return build()  # a caller's own generator class or arguments: always its own generator
        key = (threading.get_ident(), tuple(id(model) for model in models), generation_settings_key(args),
               None if prefix_allowed_tokens_fn is None else id(prefix_allowed_tokens_fn), fingerprint)
        reused: "OrderedDict" = self.__dict__.setdefault("_reused_generators", OrderedDict())
        entry = reused.get(key)
        if entry is not None:
            reused.move_to_end(key)
            return entry[1]
        generator = build()
        # (the entry holds the objects whose ids are in its key, so that no other object can take those ids)
        reused[key] = ((tuple(models), prefix_allowed_tokens_fn), generator)
        while len(reused) > self.max_reused_generators:
            reused.popitem(last=False)
        return generator


@functools.lru_cache(maxsize=None)
def reusing_hub_interface():
    """fairseq's ``GeneratorHubInterface`` whose ``generate`` (under ``translate`` and ``sample``), for a task
    that reuses its generators, skips fairseq's per-call deep copy of the generation config (0.7 ms, a sixth of
    an int8 greedy sentence on the baseline): the copy made for the same beam, keyword arguments and config is
    kept. Every other call is fairseq's own. (A function, so that importing this module imports no fairseq.)"""
    import copy

    import torch
    from fairseq import utils
    from fairseq.hub_utils import GeneratorHubInterface
    from omegaconf import open_dict

    class ReusingHubInterface(GeneratorHubInterface):
        reuses_generators = True

        def generate(self, tokenized_sentences, beam: int = 5, verbose: bool = False,
                     skip_invalid_size_inputs=False, inference_step_args=None, prefix_allowed_tokens_fn=None,
                     **kwargs):
            if verbose or not isinstance(self.task, ReusedGenerators) or (
                    torch.is_tensor(tokenized_sentences) and tokenized_sentences.dim() == 1):
                return super().generate(tokenized_sentences, beam, verbose, skip_invalid_size_inputs,
                                        inference_step_args, prefix_allowed_tokens_fn, **kwargs)
            key = (beam, repr(sorted(kwargs.items())), generation_settings_key(self.cfg.generation))
            copies = self.__dict__.setdefault("_generation_settings", {})
            settings = copies.get(key)
            if settings is None:  # fairseq's own settings of the call
                settings = copy.deepcopy(self.cfg.generation)
                with open_dict(settings):
                    settings.beam = beam
                    for name, value in kwargs.items():
                        setattr(settings, name, value)
                if len(copies) >= 8:  # (a changed config leaves its copies behind)
                    copies.pop(next(iter(copies)))
                copies[key] = settings
            generator = self.task.build_generator(self.models, settings,
                                                  prefix_allowed_tokens_fn=prefix_allowed_tokens_fn)
            results = []
            for batch in self._build_batches(tokenized_sentences, skip_invalid_size_inputs):
                batch = utils.apply_to_sample(lambda t: t.to(self.device), batch)
                translations = self.task.inference_step(generator, self.models, batch,
                                                        **(inference_step_args or {}))
                results.extend(zip(batch["id"].tolist(), translations))
            return [hypotheses for _, hypotheses in sorted(results, key=lambda pair: pair[0])]

    return ReusingHubInterface
