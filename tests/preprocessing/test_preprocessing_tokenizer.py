"""Tokenizer training and loading: fixed special ids, HF files equal to sentencepiece, all input formats."""

from __future__ import annotations

import json

import pytest
import sentencepiece as spm
from launch import run_cli

from preprocessing.documents import iter_documents
from preprocessing.errors import PreprocessingError
from preprocessing.sources import resolve_inputs
from preprocessing.tokenizer import SPECIAL_TOKENS, load_tokenizer, train_tokenizer

# Text that trips naive sentencepiece → HF conversions: whitespace runs, NFKC
# folding, unknown characters (byte fallback), literal byte-piece spellings,
# control and zero-width characters, and runs of one character (lattice ties).
TRICKY = [
    "  leading, trailing   and   repeated   spaces  ", "tab\tseparated\ttext", "ﬁne ﬀ ＡＢＣ １２３ ½ ₐ",
    "naïve café, combining e\u0301", "emoji 😀 and CJK 漢字テスト", "zero\u200bwidth", "ctrl\x01char",
    "<0x41> is not a byte", "\u3000ideographic space", "no\u00a0break", "x", "",
    *("=" * n for n in range(1, 90, 7)), *("-" * n for n in range(2, 90, 11)), "=-" * 20, "*~" * 15,
]


def _hf(directory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def test_special_ids_and_files(tokenizer_dir):
    names = {p.name for p in tokenizer_dir.iterdir()}
    assert {"tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= names
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_dir / "tokenizer.model"))
    assert [sp.id_to_piece(i) for i in range(5)] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = load_tokenizer(tokenizer_dir)
    assert tok.special_ids == {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
    assert tok.vocab_size == sp.get_piece_size() == 2000 and tok.dtype == "uint16"
    hf = _hf(tokenizer_dir)
    assert (hf.pad_token_id, hf.unk_token_id, hf.cls_token_id, hf.sep_token_id, hf.mask_token_id) == (0, 1, 2, 3, 4)
    pair = hf("first part", "second part")
    a, b = sp.encode("first part"), sp.encode("second part")
    assert pair["input_ids"] == [2, *a, 3, *b, 3]
    assert pair["token_type_ids"] == [0] * (len(a) + 2) + [1] * (len(b) + 1)


def test_hf_files_give_sentencepiece_ids_on_real_text(tokenizer_dir, corpus_documents):
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_dir / "tokenizer.model"))
    hf = _hf(tokenizer_dir)
    tok = load_tokenizer(tokenizer_dir)
    lines = [line for doc in corpus_documents for line in doc] + TRICKY
    sp_ids = sp.encode(lines)
    hf_ids = [hf.encode(line, add_special_tokens=False) for line in lines]
    assert [i for i in range(len(lines)) if sp_ids[i] != hf_ids[i]] == []
    assert [tok.encode(line) for line in lines] == sp_ids
    assert [hf.decode(ids) for ids in hf_ids] == [sp.decode(ids) for ids in sp_ids]
    # Byte fallback: nothing maps to [UNK], decoding gives back the normalised text.
    assert all(1 not in ids for ids in sp_ids)
    assert [sp.decode(ids) for ids in sp_ids] == [tok.normalize(line) for line in lines]


def test_special_token_text_is_plain_text_for_sentencepiece(tokenizer_dir):
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_dir / "tokenizer.model"))
    hf = _hf(tokenizer_dir)
    text = "fill the [MASK] in, [CLS] and [PAD] too"
    # Shards never get special ids from raw text; HF matches special tokens by default
    # (what fill-mask needs) and agrees with sentencepiece when told to split them.
    assert not {0, 1, 2, 3, 4} & set(sp.encode(text))
    assert 4 in hf.encode(text, add_special_tokens=False)
    assert hf(text, split_special_tokens=True, add_special_tokens=False)["input_ids"] == sp.encode(text)


def test_bpe_tokenizer_matches_hf_too(data_dir, corpus, corpus_documents):
    out = train_tokenizer([str(corpus)], data_dir / "bpe", vocab_size=1500, model_type="bpe")
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    hf = _hf(out)
    lines = [line for doc in corpus_documents for line in doc] + TRICKY
    mismatched = [line for line in lines if sp.encode(line) != hf.encode(line, add_special_tokens=False)]
    assert mismatched == []
    assert [sp.id_to_piece(i) for i in range(5)] == list(SPECIAL_TOKENS.values())


@pytest.mark.parametrize("variant", ["txt.gz", "txt.bz2", "txt.zst", "jsonl", "jsonl.gz", "jsonl.zst", "json",
                                     "parquet", "arrow"])
def test_every_input_format_reads_the_same_documents(corpus_variants, corpus_documents, variant):
    sources = resolve_inputs([str(corpus_variants[variant])])
    assert list(iter_documents(sources)) == corpus_documents


def test_training_from_jsonl_zst_gives_the_same_tokenizer(data_dir, corpus_variants, tokenizer_dir):
    out = train_tokenizer([str(corpus_variants["jsonl.zst"])], data_dir / "tok_from_jsonl", vocab_size=2000)
    assert load_tokenizer(out).sha256 == load_tokenizer(tokenizer_dir).sha256


def test_sampling_limits_the_training_sentences(data_dir, corpus):
    out = train_tokenizer([str(corpus)], data_dir / "tok_sampled", vocab_size=2000, input_sentence_size=300)
    summary = json.loads((out / "preprocessing_tokenizer.json").read_text())
    assert summary["settings"]["input_sentence_size"] == 300 and summary["read"]["lines"] > 300
    # Trained on 300 sampled lines, not on all of them: a different (and smaller) vocabulary.
    full = train_tokenizer([str(corpus)], data_dir / "tok_full", vocab_size=2000)
    assert load_tokenizer(out).sha256 != load_tokenizer(full).sha256


def test_wordpiece_vocab_dir_is_accepted(data_dir, corpus_documents):
    from transformers import BertTokenizer

    words = sorted({w.strip(".,:;()'\"").lower() for doc in corpus_documents for line in doc
                    for w in line.split()} - {""})
    # BERT's layout: [PAD]=0, [unused..], [UNK]=100, [CLS]=101, [SEP]=102, [MASK]=103.
    vocab = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab += list("abcdefghijklmnopqrstuvwxyz0123456789.,:;()'\"-_=*/") + words[:3000]
    vocab += [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    d = data_dir / "wordpiece"
    d.mkdir()
    (d / "vocab.txt").write_text("\n".join(dict.fromkeys(vocab)) + "\n")
    tok = load_tokenizer(d)
    assert tok.kind == "huggingface"
    assert tok.special_ids == {"pad": 0, "unk": 100, "cls": 101, "sep": 102, "mask": 103}
    bert = BertTokenizer.from_pretrained(str(d), local_files_only=True)
    lines = [line for doc in corpus_documents[:200] for line in doc]
    assert [tok.encode(line) for line in lines] == [bert.encode(line, add_special_tokens=False) for line in lines]


def test_missing_tokenizer_files_are_a_clear_error(tmp_path):
    with pytest.raises(PreprocessingError, match="no tokenizer files"):
        load_tokenizer(tmp_path)


def test_cli_trains_and_reports_bad_input_in_one_line(tmp_path, corpus):
    out = tmp_path / "tok"
    ok = run_cli("preprocessing.tokenizer", "--input", str(corpus), "--out", str(out), "--vocab-size", "1000")
    assert ok.returncode == 0, ok.stderr
    assert "vocab 1000" in ok.stdout and load_tokenizer(out).vocab_size == 1000
    missing = tmp_path / "nothing" / "*.txt"
    bad = run_cli("preprocessing.tokenizer", "--input", str(missing), "--out", str(tmp_path / "t2"))
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [f"error: --input {str(missing)!r} matches no files"]
    assert not (tmp_path / "t2").exists()
