"""Train a sentencepiece tokenizer, or load an existing tokenizer directory.

``python -m preprocessing.tokenizer --input GLOB... --out DIR [--vocab-size N]``
writes ``DIR/tokenizer.model`` (sentencepiece) and the HuggingFace files
(``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``),
so ``transformers.AutoTokenizer.from_pretrained(DIR)`` works offline and gives
the same ids as sentencepiece. Special ids are fixed: [PAD]=0, [UNK]=1,
[CLS]=2, [SEP]=3, [MASK]=4 (the model and trainer rely on them).

Two details make the HF ids equal sentencepiece's:
- the HF pipeline mirrors sentencepiece's: its precompiled normaliser, then
  strip + collapse spaces, then split on spaces with a "▁" prefix;
- unigram scores are rounded to multiples of 1/64 (see ``_quantize_scores``).
One difference is kept on purpose: text that spells a special token ("[MASK]")
is plain text to sentencepiece, so raw text never puts special ids in the
shards, while HF matches it as the special token (what fill-mask expects);
``split_special_tokens=True`` gives sentencepiece's ids there too.

``load_tokenizer(dir)`` also accepts any HuggingFace tokenizer directory, e.g. a
BERT WordPiece ``vocab.txt``; its special ids come from that tokenizer.

``DIR/preprocessing_tokenizer.json``, written last, records what was trained
(sizes, sources, settings) and the files' digests: ``sha256`` over all of them
(``tokenizer_sha256``) and ``files``, one per file. ``load_tokenizer`` checks a
directory that has it against both, so a damaged or half-copied file is named
before anything reads it.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import re
import sys
from pathlib import Path

from convbert_ds.cli import ArgumentParser, bounded
from convbert_ds.errors import first_line
from convbert_ds.fsutil import FORCE_FLAG, file_sha256, refuse_non_empty, write_dir_atomically
from preprocessing.documents import MAX_LINE_CHARS, iter_documents
from preprocessing.errors import PreprocessingError, run_cli
from preprocessing.sources import resolve_inputs

SPECIAL_TOKENS = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}
SENTENCEPIECE_FILES = ("tokenizer.model", "spiece.model", "sentencepiece.bpe.model")
SUMMARY_FILE = "preprocessing_tokenizer.json"  # written last by train_tokenizer: the directory is ours
# What train_tokenizer writes: the model, transformers' files (the converter copies them into exports)
# and the summary. A directory with the summary and not all of these was damaged or copied in part.
WRITTEN_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 SUMMARY_FILE)
# The files that define a tokenizer; their bytes make up Tokenizer.sha256.
TOKENIZER_FILES = SENTENCEPIECE_FILES + ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                         "added_tokens.json", "vocab.txt", "vocab.json", "merges.txt")
MODEL_MAX_LENGTH = 512


def tokenizer_sha256(directory: str | os.PathLike) -> str:
    """sha256 over the names and bytes of the tokenizer files present in ``directory``."""
    h = hashlib.sha256()
    for name in sorted(TOKENIZER_FILES):
        path = Path(directory) / name
        if path.is_file():
            data = path.read_bytes()
            h.update(f"{name}\0{len(data)}\0".encode())
            h.update(data)
    return h.hexdigest()


def _file_digests(directory: Path) -> dict[str, str]:
    return {name: file_sha256(directory / name) for name in TOKENIZER_FILES if (directory / name).is_file()}


def _check_against_summary(d: Path) -> None:
    """The files of a directory preprocessing.tokenizer wrote still have the digests its summary recorded."""
    path, fix = d / SUMMARY_FILE, "copy the whole tokenizer directory again, or train the tokenizer again"
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
        recorded, per_file = summary["sha256"], summary.get("files", {})
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError) as error:
        raise PreprocessingError(f"{path}: damaged ({first_line(error)}); {fix}") from None
    if tokenizer_sha256(d) == recorded:
        return
    now = _file_digests(d)
    changed = [str(d / name) for name, digest in per_file.items() if now.get(name) != digest]
    if per_file and not changed:  # every file as recorded: the record itself is what changed
        raise PreprocessingError(f"{path}: damaged (its sha256 does not match the files it lists); {fix}")
    raise PreprocessingError(f"{', '.join(changed) or d}: changed since python -m preprocessing.tokenizer wrote it "
                             f"(the sha256 in {SUMMARY_FILE} no longer matches); {fix}")


class Tokenizer:
    """A loaded tokenizer: ``encode`` adds no special tokens; ``special_ids`` has pad/unk/cls/sep/mask."""

    kind: str
    dir: Path
    vocab_size: int
    special_ids: dict[str, int]
    sha256: str

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

    def worker_spec(self) -> tuple[str, bytes | str]:
        """What a worker process needs to rebuild the encoder (see encode.LineEncoder)."""
        raise NotImplementedError

    @property
    def dtype(self) -> str:
        """megatron-core's rule (DType.optimal_dtype): uint16 below 65500 ids, else int32."""
        return "uint16" if self.vocab_size < 65500 else "int32"

    def describe(self) -> dict:
        return {"kind": self.kind, "vocab_size": self.vocab_size, "special_ids": dict(self.special_ids),
                "sha256": self.sha256}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.dir)!r}, vocab_size={self.vocab_size})"


class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"

    def __init__(self, directory: Path, model_file: Path):
        import sentencepiece  # loaded only for the tokenizer kind in use

        self.dir = directory
        self.model_proto = model_file.read_bytes()
        if not self.model_proto:  # sentencepiece loads it as a model with no pieces
            raise PreprocessingError(f"{model_file}: empty file, not a sentencepiece model; copy the tokenizer "
                                     "directory again, or train it again with python -m preprocessing.tokenizer")
        try:
            self.sp = sentencepiece.SentencePieceProcessor(model_proto=self.model_proto)
        except RuntimeError as error:  # sentencepiece's only error for a file that does not parse as a model
            why = str(error).strip().splitlines()[-1]
            raise PreprocessingError(f"{model_file}: not a sentencepiece model ({why}); "
                                     "copy the tokenizer directory again, or train it again with python -m "
                                     "preprocessing.tokenizer") from None
        self.vocab_size = self.sp.get_piece_size()
        self.special_ids = {}
        for name, piece in SPECIAL_TOKENS.items():
            i = self.sp.piece_to_id(piece)
            if self.sp.id_to_piece(i) != piece:
                raise PreprocessingError(f"{model_file}: no {piece} piece; train a tokenizer with "
                                         "python -m preprocessing.tokenizer")
            self.special_ids[name] = i
        self.sha256 = tokenizer_sha256(directory)

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts)

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])

    def normalize(self, text: str) -> str:
        """The text as the model sees it (NFKC, collapsed spaces): what ``decode(encode(text))`` returns."""
        return self.sp.normalize(text).replace("\u2581", " ").removeprefix(" ")

    def worker_spec(self) -> tuple[str, bytes]:
        return "sentencepiece", self.model_proto


class HFTokenizer(Tokenizer):
    """Any HuggingFace tokenizer directory (tokenizer.json, or a BERT vocab.txt)."""

    kind = "huggingface"

    def __init__(self, directory: Path):
        import transformers  # heavy (seconds): only for HF tokenizer dirs

        transformers.logging.set_verbosity_error()
        try:
            hf = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except Exception as e:  # noqa: BLE001 - any failure here means "not loadable this way"
            if not (directory / "vocab.txt").is_file():
                raise PreprocessingError(f"cannot load tokenizer from {directory}: {e}") from None
            hf = transformers.BertTokenizer.from_pretrained(str(directory), local_files_only=True)
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise PreprocessingError(f"{directory}: only fast (tokenizers-based) tokenizers are supported")
        self.dir, self.hf, self.backend = directory, hf, backend
        self.vocab_size = len(hf)
        self.special_ids = {}
        for name in SPECIAL_TOKENS:
            i = getattr(hf, f"{name}_token_id", None)
            if i is None:
                raise PreprocessingError(f"{directory}: the tokenizer has no {name} token "
                                         f"(ELECTRA pretraining needs {', '.join(SPECIAL_TOKENS)})")
            self.special_ids[name] = int(i)
        self.sha256 = tokenizer_sha256(directory)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.hf.decode([int(i) for i in ids])

    def worker_spec(self) -> tuple[str, str]:
        return "tokenizers", self.backend.to_str()


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """Load a tokenizer directory: our sentencepiece model if present, else a HuggingFace tokenizer."""
    d = Path(directory)
    if not d.is_dir():
        raise PreprocessingError(f"tokenizer directory {directory} does not exist")
    missing = [name for name in WRITTEN_FILES if not (d / name).is_file()]
    if (d / SUMMARY_FILE).is_file() and missing:
        raise PreprocessingError(f"tokenizer directory {d} lacks {', '.join(missing)} (python -m preprocessing.tokenizer "
                                 "writes them all): copy the whole directory, or train the tokenizer again")
    if (d / SUMMARY_FILE).is_file():
        _check_against_summary(d)
    for name in SENTENCEPIECE_FILES:
        if (d / name).is_file():
            return SentencePieceTokenizer(d, d / name)
    if (d / "tokenizer.json").is_file() or (d / "vocab.txt").is_file():
        return HFTokenizer(d)
    raise PreprocessingError(f"{directory}: no tokenizer files (expected tokenizer.model, tokenizer.json or vocab.txt)")


# ---------------------------------------------------------------------------
# training


def _quantize_scores(model_proto: bytes, step: float = 1 / 64) -> bytes:
    """Round the unigram piece scores to multiples of ``step``.

    sentencepiece sums lattice scores in float32, HF tokenizers in float64. On
    text with near-ties (runs like "=====" that split into the same pieces in
    different orders) the two roundings picked different segmentations. With
    scores on a 1/64 grid every sum up to 2**18 is exact in both, ties are
    true ties, and both libraries break them the same way. The change to any
    score is below 1/128 nats, far below what separates real alternatives.
    """
    from sentencepiece import sentencepiece_model_pb2 as pb  # protobuf: only when training

    m = pb.ModelProto.FromString(model_proto)
    if m.trainer_spec.model_type != pb.TrainerSpec.UNIGRAM:
        return model_proto
    for piece in m.pieces:
        if piece.type == pb.ModelProto.SentencePiece.NORMAL:
            piece.score = round(piece.score / step) * step
    return m.SerializeToString()


def sentencepiece_to_hf(model_proto: bytes):
    """Build a ``tokenizers.Tokenizer`` that encodes exactly like the sentencepiece model."""
    # Only when training: protobuf and the HF tokenizers library are not needed to shard.
    from sentencepiece import sentencepiece_model_pb2 as pb
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFBackend

    m = pb.ModelProto.FromString(model_proto)
    spec, norm = m.trainer_spec, m.normalizer_spec
    if not (norm.add_dummy_prefix and norm.remove_extra_whitespaces and norm.escape_whitespaces
            and spec.split_by_whitespace):
        raise PreprocessingError("only sentencepiece models with the default whitespace handling can be exported")
    kinds = pb.ModelProto.SentencePiece
    # Byte pieces ("<0x41>") and control pieces ("[MASK]") are never matched against
    # text by sentencepiece; keep them out of HF's lattice the same way (byte
    # fallback still finds byte pieces by name; specials are added tokens below).
    matchable = (kinds.NORMAL, kinds.USER_DEFINED)
    vocab = [(p.piece, p.score if p.type in matchable else -1e6) for p in m.pieces]
    ids = {p.piece: i for i, p in enumerate(m.pieces)}
    if spec.model_type == pb.TrainerSpec.UNIGRAM:
        model = models.Unigram(vocab, unk_id=spec.unk_id, byte_fallback=spec.byte_fallback)
    elif spec.model_type == pb.TrainerSpec.BPE:
        merges = []
        for i, p in enumerate(m.pieces):
            if p.type != kinds.NORMAL:
                continue
            # sentencepiece merges the adjacent pair whose union scores best; a
            # BPE merge list ranked by the union's id (= score order) does the same.
            splits = [(p.piece[:k], p.piece[k:]) for k in range(1, len(p.piece))
                      if p.piece[:k] in ids and p.piece[k:] in ids]
            merges.extend((i, ids[a], ids[b], a, b) for a, b in splits)
        merges.sort()
        model = models.BPE(ids, [(a, b) for *_, a, b in merges],
                           unk_token=m.pieces[spec.unk_id].piece, fuse_unk=True, byte_fallback=spec.byte_fallback)
    else:
        raise PreprocessingError("only unigram and bpe sentencepiece models can be exported")
    tok = HFBackend(model)
    steps = [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    if norm.precompiled_charsmap:
        steps.insert(0, normalizers.Precompiled(norm.precompiled_charsmap))
    tok.normalizer = normalizers.Sequence(steps)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = [p.piece for p in m.pieces if p.type in (kinds.CONTROL, kinds.UNKNOWN)]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    cls, sep = SPECIAL_TOKENS["cls"], SPECIAL_TOKENS["sep"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, ids[cls]), (sep, ids[sep])])
    return tok


def write_hf_files(directory: Path, model_proto: bytes) -> None:
    """tokenizer.json + tokenizer_config.json + special_tokens_map.json for ``AutoTokenizer``."""
    sentencepiece_to_hf(model_proto).save(str(directory / "tokenizer.json"))
    specials = {f"{name}_token": piece for name, piece in SPECIAL_TOKENS.items()}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **specials, "model_max_length": MODEL_MAX_LENGTH,
              "model_input_names": ["input_ids", "token_type_ids", "attention_mask"],
              "clean_up_tokenization_spaces": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")


def train_tokenizer(inputs: list[str], out: str | os.PathLike, vocab_size: int = 30522,
                    model_type: str = "unigram", text_field: str = "text",
                    input_sentence_size: int = 2_000_000, character_coverage: float = 0.9995,
                    byte_fallback: bool = True, strict: bool = False, seed: int = 0,
                    num_threads: int | None = None, overwrite: bool = False, verbose: bool = False) -> Path:
    """Train a sentencepiece tokenizer on ``inputs`` and write it (plus HF files) to ``out``.

    At most ``input_sentence_size`` lines, sampled uniformly from the whole
    corpus, are held in memory. The directory appears only when complete.
    Returns the output directory.
    """
    import sentencepiece as spm  # loaded only for the tokenizer kind in use

    if model_type not in ("unigram", "bpe"):
        raise PreprocessingError(f"--model-type {model_type!r}: expected unigram or bpe")
    out = Path(out)
    refuse_non_empty(out, overwrite, PreprocessingError)
    sources = resolve_inputs(inputs, text_field)

    stats: dict[str, int] = {}

    def train(size: int) -> bytes:
        sentences = itertools.chain.from_iterable(iter_documents(sources, text_field, strict, MAX_LINE_CHARS, stats))
        model = io.BytesIO()
        spm.set_random_generator_seed(seed)
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences, model_writer=model,
            model_type=model_type, vocab_size=size, hard_vocab_limit=False,
            character_coverage=character_coverage, byte_fallback=byte_fallback,
            pad_id=0, unk_id=1, bos_id=2, eos_id=3,
            pad_piece=SPECIAL_TOKENS["pad"], unk_piece=SPECIAL_TOKENS["unk"],
            bos_piece=SPECIAL_TOKENS["cls"], eos_piece=SPECIAL_TOKENS["sep"],
            control_symbols=[SPECIAL_TOKENS["mask"]],
            input_sentence_size=input_sentence_size, shuffle_input_sentence=True,
            max_sentence_length=4 * MAX_LINE_CHARS, normalization_rule_name="nmt_nfkc",
            num_threads=num_threads or os.cpu_count() or 1, minloglevel=0 if verbose else 2)
        return model.getvalue()

    reserved = len(SPECIAL_TOKENS) + (256 if byte_fallback else 0)  # sentencepiece's meta pieces
    try:
        # A size below the reserved pieces fails inside sentencepiece before it counts the corpus's
        # characters; asking for one more than reserved makes it report the smallest size that works.
        proto = train(vocab_size if vocab_size > reserved else reserved + 1)
        if vocab_size <= reserved:
            raise PreprocessingError(f"--vocab-size {vocab_size} is too small: every tokenizer reserves {reserved} "
                                     f"pieces (5 special tokens{' + 256 byte-fallback pieces' if byte_fallback else ''})"
                                     f"; use --vocab-size {reserved + 1} or more")
    except RuntimeError as e:
        if not stats.get("lines"):
            raise PreprocessingError(f"no text found in {', '.join(inputs)}") from None
        needed = re.search(r"Vocabulary size is smaller than required_chars\. \d+ vs (\d+)", str(e))
        if needed:
            raise PreprocessingError(
                f"--vocab-size {vocab_size} is too small for this corpus: it needs at least {needed.group(1)} pieces "
                f"({reserved} reserved + the characters that cover {character_coverage:g} of its text); use "
                f"--vocab-size {needed.group(1)} or more, or a lower --character-coverage") from None
        raise PreprocessingError(f"sentencepiece training failed: {e}") from None
    proto = _quantize_scores(proto)

    def fill(tmp: Path) -> None:
        (tmp / "tokenizer.model").write_bytes(proto)
        write_hf_files(tmp, proto)
        tok = SentencePieceTokenizer(tmp, tmp / "tokenizer.model")
        summary = {"vocab_size": tok.vocab_size, "requested_vocab_size": vocab_size, "model_type": model_type,
                   "special_ids": tok.special_ids, "sha256": tok.sha256, "files": _file_digests(tmp),
                   "sources": [s.describe() for s in sources], "read": stats,
                   "settings": {"input_sentence_size": input_sentence_size,
                                "character_coverage": character_coverage, "byte_fallback": byte_fallback,
                                "text_field": text_field, "seed": seed}}
        (tmp / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")

    return write_dir_atomically(out, fill)


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m preprocessing.tokenizer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", action="extend", required=True, metavar="GLOB",
                        help="text/JSONL/JSON/Parquet files, save_to_disk dirs, globs; .gz/.bz2/.xz/.zst ok")
    parser.add_argument("--out", required=True, help="tokenizer directory to write")
    parser.add_argument("--vocab-size", type=bounded(int, min=1), default=30522, help="pieces in the vocabulary")
    parser.add_argument("--model-type", choices=("unigram", "bpe"), default="unigram", help="sentencepiece model")
    parser.add_argument("--text-field", default="text", help="field holding the text in JSON/Parquet/Arrow inputs")
    parser.add_argument("--input-sentence-size", type=bounded(int, min=1), default=2_000_000,
                        help="lines sampled for training (bounds memory)")
    parser.add_argument("--character-coverage", type=bounded(float, min=0.5, max=1), default=0.9995,
                        help="share of characters the vocabulary covers")
    parser.add_argument("--no-byte-fallback", action="store_true",
                        help="map unknown characters to [UNK] instead of UTF-8 byte pieces")
    parser.add_argument("--strict", action="store_true", help="invalid UTF-8 is an error instead of replaced")
    parser.add_argument("--seed", type=bounded(int, min=0), default=0, help="sentencepiece's random seed")
    parser.add_argument("--threads", type=bounded(int, min=1), default=os.cpu_count() or 1, help="training threads")
    parser.add_argument(FORCE_FLAG, "--overwrite", dest="overwrite", action="store_true",
                        help="replace a non-empty output directory")
    parser.add_argument("--verbose", action="store_true", help="show sentencepiece's training log")
    args = parser.parse_args(argv)
    out = train_tokenizer(args.input, args.out, args.vocab_size, args.model_type, args.text_field,
                          args.input_sentence_size, args.character_coverage, not args.no_byte_fallback, args.strict,
                          args.seed, args.threads, args.overwrite, args.verbose)
    summary = json.loads((out / SUMMARY_FILE).read_text())
    read = summary["read"]
    print(f"wrote {out}: {summary['model_type']} vocab {summary['vocab_size']} "
          f"(asked {summary['requested_vocab_size']}), sha256 {summary['sha256'][:12]}")
    other = ", ".join(f"{k} {v}" for k, v in read.items() if k not in ("documents", "lines") and v)
    print(f"read {read.get('documents', 0)} documents, {read.get('lines', 0)} lines; {other or 'nothing skipped'}")


if __name__ == "__main__":
    sys.exit(run_cli(main))
