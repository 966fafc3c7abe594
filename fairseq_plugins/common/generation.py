"""What the methods' own generators share (registers nothing): the fairseq generation flags they refuse, the
statistics bench records (``GenerationStats``), and the start of every ``generate`` call (refused inputs, one
summary line at exit)."""

import atexit
from typing import Dict, Optional, Sequence

from .textio import InputError


# fairseq's own defaults (its GenerationConfig) of the search flags a method's generator may take, for args that
# lack one (a Namespace built by hand; fairseq-generate's args hold them all)
SEARCH_DEFAULTS = {"beam": 5, "nbest": 1, "temperature": 1.0, "no_repeat_ngram_size": 0}


def generator_options(args, *search: str, **defaults) -> Dict:
    """A method generator's keyword arguments from fairseq's generation flags in ``args``: the step rules
    (``StepRules``' max_len_a, max_len_b, min_len, len_penalty, normalize_scores, unk_penalty, from --max-len-a/b,
    --min-len, --lenpen, --unnormalized, --unkpen) and the search flags named in ``search`` (beam, nbest,
    temperature, no_repeat_ngram_size). ``defaults`` replaces fairseq's default of a search flag."""
    options = {"max_len_a": getattr(args, "max_len_a", 0), "max_len_b": getattr(args, "max_len_b", 200),
               "min_len": getattr(args, "min_len", 1), "len_penalty": getattr(args, "lenpen", 1.0),
               "normalize_scores": not getattr(args, "unnormalized", False),
               "unk_penalty": getattr(args, "unkpen", 0.0)}
    for name in search:
        options[name] = getattr(args, name, defaults.get(name, SEARCH_DEFAULTS[name]))
    return options


def refuse_unsupported_generation_flags(args, context: str, extra: Optional[Dict[str, bool]] = None,
                                        supported: Sequence[str] = ()) -> None:
    """Raise an InputError naming the first fairseq generation flag set in ``args`` that a method's own generator
    does not implement; ``extra`` maps further flag descriptions to whether they were given (checked first);
    flags in ``supported`` are the generator's to handle."""
    unsupported = {
        **(extra or {}),
        "--sampling": getattr(args, "sampling", False),
        "--print-alignment": bool(getattr(args, "print_alignment", None)),
        "--match-source-len": getattr(args, "match_source_len", False),
        "--no-repeat-ngram-size": getattr(args, "no_repeat_ngram_size", 0) > 0,
        "--diverse-beam-groups": getattr(args, "diverse_beam_groups", -1) > 0,
        "--diversity-rate": getattr(args, "diversity_rate", -1) > 0,
        "--constraints": bool(getattr(args, "constraints", None)),
        "--prefix-size": getattr(args, "prefix_size", 0) > 0,
        "--score-reference": getattr(args, "score_reference", False),
    }
    for flag, given in unsupported.items():
        if given and flag not in supported:
            raise InputError(f"{flag}: not supported with {context}")


class GenerationStats:
    """The statistics protocol of a generator: ``fairseq-plugins bench`` resets them after its warm-up and stores
    ``generation_stats()`` (cumulative figures) under ``stats``; a generator without it records none. A subclass
    names its counters with their starting values (``stat_counters``), counts into ``self._stats``, calls
    ``reset_generation_stats()`` once built, and extends ``generation_stats`` with figures derived from them."""

    stat_counters: Dict[str, float] = {}

    def reset_generation_stats(self) -> None:
        self._stats = dict(self.stat_counters)

    def generation_stats(self) -> Dict:
        return dict(self._stats)


class MethodGenerator(GenerationStats):
    """Base of a method's own generator. Subclasses name the method (``method_name``, as in its error
    messages) and define ``_log_summary``, which fairseq-generate's process runs once at exit."""

    method_name = "this"
    _summary_registered = False

    def _begin_generate(self, prefix_tokens, constraints) -> None:
        """Refuse what fairseq may pass but the method does not implement; register the summary once."""
        if prefix_tokens is not None:
            raise InputError(f"{self.method_name} decoding does not support --prefix-size")
        if constraints is not None:
            raise InputError(f"{self.method_name} decoding does not support --constraints")
        if not self._summary_registered:
            atexit.register(self._log_summary)
            self._summary_registered = True
