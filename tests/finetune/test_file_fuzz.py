"""Property-based: whatever a SQuAD or CoNLL file holds, reading it gives questions or sentences, or ends in
one line (a ``UserError``): never a traceback. SQuAD files are valid ones with one value anywhere replaced by
any JSON; CoNLL files are any bytes, and lines of words and tags of any shape."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from convbert_ds.errors import UserError
from convbert_ds.finetune.squad import read_squad
from convbert_ds.finetune.tagging import read_conll

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

JSON = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False)
                    | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                                  max_size=4), max_leaves=12)
VALID = {"version": "1.1", "data": [{"title": "t", "paragraphs": [
    {"context": "Paris is the capital of France.",
     "qas": [{"id": "q1", "question": "What is the capital?", "answers": [{"text": "Paris", "answer_start": 0}]},
             {"id": "q2", "question": "Of what?", "is_impossible": True, "answers": []}]}]}]}


def _paths(value, path=()):
    """Every place in a JSON value: key or index paths."""
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, (*path, index))


PLACES = list(_paths(VALID))


def _replaced(place, value):
    document = json.loads(json.dumps(VALID))
    if not place:
        return value
    parent = document
    for step in place[:-1]:
        parent = parent[step]
    parent[place[-1]] = value
    return document


def _one_line_or_read(read):
    try:
        return read()
    except UserError as error:
        assert "\n" not in str(error), str(error)


@FUZZ
@given(place=st.sampled_from(PLACES), value=JSON, version_2=st.booleans())
def test_any_value_anywhere_in_a_squad_file_is_read_or_one_line(tmp_path_factory, place, value, version_2):
    path = tmp_path_factory.mktemp("squad") / "dev.json"
    path.write_text(json.dumps(_replaced(place, value)))
    _one_line_or_read(lambda: read_squad(path, version_2))


@FUZZ
@given(data=st.binary(max_size=200))
def test_any_bytes_as_a_conll_file_are_read_or_one_line(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("conll") / "train.txt"
    path.write_bytes(data)
    _one_line_or_read(lambda: read_conll(path))


WORD = st.text(st.characters(blacklist_categories=["Cs"]), min_size=0, max_size=6)


@FUZZ
@given(lines=st.lists(st.lists(WORD, max_size=4).map(" ".join), max_size=12))
def test_any_lines_of_words_and_tags_are_read_or_one_line(tmp_path_factory, lines):
    path = tmp_path_factory.mktemp("conll") / "train.txt"
    path.write_text("\n".join(lines), encoding="utf-8")
    _one_line_or_read(lambda: read_conll(path))
