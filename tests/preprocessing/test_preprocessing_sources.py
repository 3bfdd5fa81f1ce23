"""Reading inputs as chunks: resumable positions, slices that partition the documents, giant documents."""

from __future__ import annotations

import json

import pytest

from preprocessing.documents import parse_chunk
from preprocessing.sources import iter_chunks, plan_slice, resolve_inputs


def _documents(chunks, sources) -> list[list[str]]:
    docs = []
    for chunk in chunks:
        docs += parse_chunk(chunk, sources[chunk.source].path, False, "text", 16384).documents()
    return docs


@pytest.mark.parametrize("variant", ["txt", "txt.gz", "jsonl", "jsonl.zst", "parquet", "arrow", "json"])
def test_reading_resumes_exactly_at_the_recorded_position(corpus_variants, variant):
    sources = resolve_inputs([str(corpus_variants[variant])])
    ranges = plan_slice(sources, 0, 1)
    chunks = list(iter_chunks(sources, ranges, block_bytes=8192))
    assert len(chunks) > 10
    key = [(c.index, c.offset, c.data, c.next_position) for c in chunks]
    for k in (0, 3, len(chunks) // 2, len(chunks) - 2):
        resumed = iter_chunks(sources, ranges, block_bytes=8192, start=(k + 1, chunks[k].next_position))
        assert [(c.index, c.offset, c.data, c.next_position) for c in resumed] == key[k + 1:]
        # ... and re-reading a chunk from its own position gives it again.
        again = next(iter_chunks(sources, ranges, block_bytes=8192, start=(k, chunks[k].position)))
        assert (again.offset, again.data) == (chunks[k].offset, chunks[k].data)


def test_slices_partition_the_documents(tmp_path, corpus_documents):
    docs = corpus_documents[:400]
    # Irregular separators: CRLF, whitespace-only lines, runs of blank lines.
    seps = ["\n\n", "\r\n\r\n", "\n  \n", "\n\n\n\n", "\n\t\n\n"]
    text = "".join("\n".join(d) + seps[i % len(seps)] for i, d in enumerate(docs[:250]))
    (tmp_path / "a.txt").write_text(text)
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": "\n".join(d)}) + "\n" for d in docs[250:330]))
    (tmp_path / "c.txt").write_text("\n\n".join("\n".join(d) for d in docs[330:]))
    sources = resolve_inputs([str(tmp_path / "*")])
    whole = _documents(iter_chunks(sources, plan_slice(sources, 0, 1), block_bytes=4096), sources)
    assert whole == docs
    for count in (2, 3, 5, 8, 13):
        parts = [_documents(iter_chunks(sources, plan_slice(sources, i, count), block_bytes=4096), sources)
                 for i in range(count)]
        assert [d for part in parts for d in part] == docs, count
        assert sum(1 for part in parts if part) >= min(count, 3)


def test_giant_documents_are_cut_safely(tmp_path):
    lines = [f"line {i} " + "é" * 50 for i in range(2000)]  # one document of ~230 kB
    (tmp_path / "lines.txt").write_text("\n".join(lines) + "\n")
    (tmp_path / "one_line.txt").write_text("é" * 100_001)  # no newline, no space: cut at character edges
    for name, cut_at_line in (("lines.txt", True), ("one_line.txt", False)):
        sources = resolve_inputs([str(tmp_path / name)])
        chunks = list(iter_chunks(sources, plan_slice(sources, 0, 1), block_bytes=4096, max_document_bytes=50_000))
        assert len(chunks) > 3 and all(len(c.data) <= 50_000 for c in chunks)
        assert [c.forced_cut for c in chunks] == [True] * (len(chunks) - 1) + [False]
        texts = [c.data.decode("utf-8") for c in chunks]  # never a split character
        if cut_at_line:
            assert all(t.endswith("\n") for t in texts) and "".join(texts).split("\n")[:-1] == lines
        else:
            assert "".join(texts) == "é" * 100_001
