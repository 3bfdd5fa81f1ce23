"""``python -m convbert_ds.convert``: see ``convbert_ds.convert``. Errors: one line on stderr, exit code 2."""

from __future__ import annotations

import shlex
import sys

from convbert_ds.convert.from_hf import convert_from_hf
from convbert_ds.convert.model_card import CardLicense
from convbert_ds.convert.reader import quiet
from convbert_ds.convert.to_hf import convert_checkpoint
from convbert_ds.cli import ArgumentParser, exit_on_user_error
from convbert_ds.formats.init_dir import ConvertError
from convbert_ds.fsutil import FORCE_FLAG


def parse_args(argv):
    parser = ArgumentParser(prog="python -m convbert_ds.convert",
                     description="DeepSpeed checkpoint -> transformers ConvBERT (and back, with --from-hf).")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="CKPT_DIR", help="the trainer's checkpoint.dir (or one tag in it)")
    source.add_argument("--from-hf", metavar="HF_DIR", help="a transformers ConvBERT directory to start training from")
    parser.add_argument("--out", required=True, help=f"output directory (refused if not empty, unless {FORCE_FLAG})")
    parser.add_argument("--tag", help="checkpoint tag, e.g. step00010000 (None: the newest complete one)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="weights' dtype in OUT")
    parser.add_argument("--verify", action="store_true",
                        help="compare our model on the checkpoint with transformers on OUT (max abs diff <= 1e-4)")
    parser.add_argument(FORCE_FLAG, action="store_true", help="replace a non-empty OUT")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="tokenizer dir, if the recorded one moved (must have the recorded sha256)")
    parser.add_argument("--from-hf-generator", metavar="GEN_DIR",
                        help="with --from-hf: a ConvBertForMaskedLM directory holding the ELECTRA generator")
    parser.add_argument("--objective", choices=("electra", "mlm"), default="electra",
                        help="with --from-hf: the pretraining objective the INIT_DIR is for")
    parser.add_argument("--license", metavar="ID", help="the model card's license: a Hub license id (apache-2.0, "
                        "...) or other (then --license-name); none: the card leaves it to you")
    parser.add_argument("--license-name", metavar="NAME", help="with --license other: its id, e.g. my-license-1.0")
    parser.add_argument("--license-link", metavar="LINK",
                        help="with --license other: its text, a URL or LICENSE (a file you add beside the card)")
    args = parser.parse_args(argv)
    if args.checkpoint and (args.from_hf_generator or args.objective != "electra"):
        raise ConvertError("--from-hf-generator and --objective go with --from-hf")
    if args.from_hf and (args.tag or args.verify or args.dtype != "fp32"):
        raise ConvertError("--tag, --verify and --dtype go with --checkpoint")
    licensed = args.license or args.license_name or args.license_link
    if args.from_hf and licensed:
        raise ConvertError("--license, --license-name and --license-link go with --checkpoint (a model card's)")
    # Checked here, before any work: a refused license is one line, not a failed conversion.
    args.card_license = CardLicense(args.license or "other", args.license_name, args.license_link) if licensed \
        else None
    return args


def run(args, command: str) -> str:
    if args.from_hf:
        init = convert_from_hf(args.from_hf, args.out, generator_dir=args.from_hf_generator,
                               objective=args.objective, tokenizer=args.tokenizer, force=args.force)
        lines = [f"wrote {args.out}: {len(init['tensors'])} tensors ({init['objective']}), tokenizer "
                 f"{init['tokenizer']['kind']} vocab {init['tokenizer']['vocab_size']}"]
        return "\n".join(lines + [f"note: {n}" for n in init["notes"]])
    # DeepSpeed logs its accelerator choice to stdout on import; the converter's output stays its own.
    with quiet():
        import deepspeed  # noqa: F401  # here, not at the top: only --checkpoint needs it, and quietly
    report = convert_checkpoint(args.checkpoint, args.out, tag=args.tag, dtype=args.dtype, verify=args.verify,
                                force=args.force, tokenizer=args.tokenizer, command=command,
                                card_license=args.card_license)
    lines = [f"wrote {args.out}"]
    if report:
        lines.append("verified: max abs difference " + ", ".join(f"{k} {v:.2e}" for k, v in report.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)

    def convert() -> None:
        print(run(parse_args(argv), "python -m convbert_ds.convert " + shlex.join(argv)))

    return exit_on_user_error(convert, prefix="convert error")


if __name__ == "__main__":
    sys.exit(main())
