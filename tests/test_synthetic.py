"""The embedded synthetic corpus is deterministic and really reorders."""

import random

from fairseq_plugins.tools import synthetic


def test_same_seed_same_corpus_and_layout(tmp_path):
    sizes = {"train": 50, "val": 5, "test_2016_flickr": 5}
    a = synthetic.write_corpus(str(tmp_path / "a"), sizes=sizes)
    b = synthetic.write_corpus(str(tmp_path / "b"), sizes=sizes)
    for name in ("train.src", "train.tgt", "val.src", "test_2016_flickr.tgt"):
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text()
    assert len((tmp_path / "a" / "train.src").read_text().splitlines()) == 50
    assert a != b


def test_target_is_a_reordered_word_for_word_translation():
    rng = random.Random(7)
    for _ in range(200):
        source, target = synthetic.sentence_pair(rng)
        source_words, target_words = source.split(), target.split()
        assert len(source_words) == len(target_words)
        verb = next(w for w in source_words if w in synthetic._VERBS)
        assert target_words[-2] == synthetic._translate_word(verb)  # verb last, before the full stop
        assert sorted(map(synthetic._translate_word, source_words[:-1])) == sorted(target_words[:-1])
