"""A corpus of many small files (a directory of articles, docs or code) shards to exactly what their
concatenation gives, document by document: small files travel to the workers in groups, but are read,
split and written as before."""

import json

from preprocessing.shard import shard_corpus


def test_two_thousand_tiny_files_equal_their_concatenation(tmp_path, corpus_documents, tokenizer_dir):
    docs = (corpus_documents * (2000 // len(corpus_documents) + 1))[:2000]
    files = tmp_path / "articles"
    files.mkdir()
    for i, doc in enumerate(docs):  # one document per file, in name order
        (files / f"article-{i:05d}.txt").write_text("\n".join(doc) + "\n")
    joined = tmp_path / "joined.txt"
    joined.write_text("".join("\n".join(doc) + "\n\n" for doc in docs))

    settings = dict(shard_tokens=20_000, valid_fraction=0.05)
    many = shard_corpus([str(files)], str(tokenizer_dir), tmp_path / "many", workers=2, **settings)
    one = shard_corpus([str(joined)], str(tokenizer_dir), tmp_path / "one", workers=2, **settings)

    assert len(many["sources"]) == 2000 and all(s["documents"] == 1 for s in many["sources"])
    assert many["documents_read"] == one["documents_read"] == 2000
    # Same documents, same split, same tokens, byte for byte (the shard files' sha256 are in the splits).
    assert json.dumps(many["splits"], sort_keys=True) == json.dumps(one["splits"], sort_keys=True)
    assert len(many["splits"]["train"]["shards"]) > 3 and many["splits"]["valid"]["documents"] > 0
    for entry in many["splits"]["train"]["shards"]:
        for ext in ("bin", "idx"):
            assert (tmp_path / "many" / f"{entry['prefix']}.{ext}").read_bytes() == \
                (tmp_path / "one" / f"{entry['prefix']}.{ext}").read_bytes()
