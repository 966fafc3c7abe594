"""The fairseq generation flags the methods' own generators refuse (common/generation.py), parsed by fairseq's
own command-line parser, so a wrong attribute name for a flag fails here."""

import pytest
from fairseq import options

from fairseq_plugins.common.generation import MethodGenerator, refuse_unsupported_generation_flags

REFUSED = [
    ["--sampling"],
    ["--print-alignment"],
    ["--match-source-len"],
    ["--no-repeat-ngram-size", "2"],
    ["--diverse-beam-groups", "2"],
    ["--diversity-rate", "0.5"],
    ["--constraints"],
    ["--prefix-size", "1"],
    ["--score-reference"],
]


def generation_args(*flags):
    parser = options.get_generation_parser()
    return options.parse_args_and_arch(parser, ["data-bin", *flags])


@pytest.mark.parametrize("flags", REFUSED, ids=lambda flags: flags[0])
def test_each_unsupported_fairseq_flag_is_refused_by_name(flags):
    with pytest.raises(ValueError, match=f"^{flags[0]}: not supported with the test method$"):
        refuse_unsupported_generation_flags(generation_args(*flags), "the test method")


def test_plain_generation_flags_and_extra_checks():
    args = generation_args("--beam", "5", "--lenpen", "1.2", "--max-len-b", "50", "--nbest", "2")
    refuse_unsupported_generation_flags(args, "the test method")  # nothing refused
    with pytest.raises(ValueError, match="^--beam > 1: not supported with x$"):
        refuse_unsupported_generation_flags(args, "x", extra={"--beam > 1": True})
    # The method's own checks come first.
    with pytest.raises(ValueError, match="^--own: not supported"):
        refuse_unsupported_generation_flags(generation_args("--sampling"), "x", extra={"--own": True})


def test_a_generate_call_with_a_prefix_or_constraints_is_refused():
    class Method(MethodGenerator):
        method_name = "test-method"

        def _log_summary(self):
            pass

    generator = Method()
    with pytest.raises(ValueError, match="test-method decoding does not support --prefix-size"):
        generator._begin_generate(prefix_tokens=[[4]], constraints=None)
    with pytest.raises(ValueError, match="test-method decoding does not support --constraints"):
        generator._begin_generate(prefix_tokens=None, constraints=[[4]])
    generator._begin_generate(prefix_tokens=None, constraints=None)
    assert generator._summary_registered  # its summary runs at exit, once


def test_a_flag_the_generator_supports_is_not_refused():
    args = generation_args("--no-repeat-ngram-size", "3")
    refuse_unsupported_generation_flags(args, "x", supported=("--no-repeat-ngram-size",))
    with pytest.raises(ValueError, match="^--sampling: not supported with x$"):
        refuse_unsupported_generation_flags(generation_args("--sampling"), "x", supported=("--no-repeat-ngram-size",))
