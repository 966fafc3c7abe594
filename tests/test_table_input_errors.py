"""Bad input to the lattice's IBM-2 tables and rnn_fc's candidate lists: a clear error naming the file, line or
flag, before any work (the checks in lattice/ibm2.py and kernels/shortlist.py that no other test runs)."""

import os
import re

import pytest
import torch

from conftest import word_dictionary

from fairseq_plugins.common.textio import InputError
from fairseq_plugins.lattice.ibm2 import TABLE_FORMAT, CandidateTable, read_binarized_pairs
from fairseq_plugins.kernels.shortlist import Shortlist, read_lexical_table


def build(sources, targets, alignments, **kwargs):
    dictionary = word_dictionary()
    return CandidateTable.build(sources, targets, alignments, dictionary, dictionary, alignment_path="a.txt", **kwargs)


def test_ibm2_table_build_checks_its_inputs():
    pair = ([[4, 5]], [[6, 7]], [[(0, 0), (1, 1)]])
    assert build(*pair).top_n == 40  # the good input builds
    with pytest.raises(InputError, match=r"^--top-n 0: keep at least one target token per context$"):
        build(*pair, top_n=0)
    with pytest.raises(InputError, match=r"^a.txt has 2 lines for 1 sentence pairs$"):
        build([[4, 5]], [[6, 7]], [[(0, 0)], [(1, 1)]])
    with pytest.raises(InputError, match=r"^a.txt: no sentence pair with tokens on both sides$"):
        build([[], [4]], [[6], []], [[], []])


def test_ibm2_table_of_another_version_is_refused(tmp_path):
    path = tmp_path / "old.table"
    torch.save({"format": TABLE_FORMAT, "version": -1}, path)
    with pytest.raises(InputError, match=r"old.table: lattice table version -1; .* rebuild it"):
        CandidateTable.load(str(path))


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_lexical_table_errors_name_the_file_and_line(tmp_path):
    with pytest.raises(InputError, match=r"missing.txt: no such lexical table$"):
        read_lexical_table(str(tmp_path / "missing.txt"))
    with pytest.raises(InputError, match=r"positive.txt:2: 0.5 is not a log-probability \(must be <= 0\)$"):
        read_lexical_table(write(tmp_path / "positive.txt", "a\tb\t-0.1\na\tc\t0.5\n"))
    with pytest.raises(InputError, match=r"nan.txt:1: nan is not a log-probability"):
        read_lexical_table(write(tmp_path / "nan.txt", "a\tb\tnan\n"))
    with pytest.raises(InputError, match=r"empty.txt: empty lexical table$"):
        read_lexical_table(write(tmp_path / "empty.txt", ""))
    assert read_lexical_table(write(tmp_path / "good.txt", "a\tb\t-0.1\na\tc\t0\n")) == {"a": [(-0.1, "b"), (0.0, "c")]}


def test_candidate_list_flags_and_files_are_checked(tmp_path):
    dictionary = word_dictionary()
    table = {"w1": [(-0.1, "w2")]}
    with pytest.raises(InputError, match=r"^--top 0: needs at least one translation per source word$"):
        Shortlist.build(table, dictionary, dictionary, top=0)
    foreign = tmp_path / "foreign.pt"
    torch.save({"something": "else"}, foreign)
    with pytest.raises(InputError, match=r"foreign.pt: not a candidate list file of format"):
        Shortlist.load(str(foreign))
    garbage = write(tmp_path / "garbage.pt", "not a torch file")
    with pytest.raises(InputError, match=r"garbage.pt: not a candidate list file \("):
        Shortlist.load(garbage)


def test_a_negative_frequent_count_is_refused():
    dictionary = word_dictionary()
    table = {"w1": [(-0.1, "w2")]}
    with pytest.raises(InputError, match=r"^--frequent -1: must not be negative$"):
        Shortlist.build(table, dictionary, dictionary, frequent=-1)
    assert Shortlist.build(table, dictionary, dictionary, frequent=0).frequent.numel() == 0  # zero is allowed


def exactly(message):
    return "^" + re.escape(message) + "$"


def test_binarised_pairs_need_both_dictionaries_and_the_split(tmp_path):
    data_bin = str(tmp_path)
    # An empty directory: the source dictionary is the first thing missing.
    source_dict = os.path.join(data_bin, "dict.src.txt")
    with pytest.raises(InputError, match=exactly(f"{source_dict}: no such dictionary "
                                                 f"(is {data_bin} fairseq-preprocess output?)")):
        read_binarized_pairs(data_bin, "train", "src", "tgt")
    # The source dictionary alone: the target one is named.
    word_dictionary().save(source_dict)
    target_dict = os.path.join(data_bin, "dict.tgt.txt")
    with pytest.raises(InputError, match=exactly(f"{target_dict}: no such dictionary "
                                                 f"(is {data_bin} fairseq-preprocess output?)")):
        read_binarized_pairs(data_bin, "train", "src", "tgt")
    # Both dictionaries but no binarised data: the split's source .bin is named.
    word_dictionary().save(target_dict)
    split = os.path.join(data_bin, "train.src-tgt.src.bin")
    with pytest.raises(InputError, match=exactly(f"{split}: no such binarised split")):
        read_binarized_pairs(data_bin, "train", "src", "tgt")
