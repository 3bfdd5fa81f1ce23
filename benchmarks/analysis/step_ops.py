"""Where an eager ELECTRA step's time goes, op by op and input shape by input shape, for one-document
samples and for packed ones (``document_ids``, the trainer's default), side by side.

    python benchmarks/analysis/step_ops.py              # CUDA: base, batch 128 x 128, bf16 autocast; CPU: tiny, 2 x 32
    python benchmarks/analysis/step_ops.py --preset small --batch 32 --top 20

Same weights and batch for both rows; the packed row splits each sample into three documents. Each row
runs 3 steps of warm-up, then ``--steps`` under ``torch.profiler`` with the input shapes recorded, and
prints its time per step (the device's busy time on CUDA, the host's on CPU) and the ops with the most
time of their own, grouped by input shape: the table that says which layer a costly kernel belongs to.
The model alone, with torch's fused AdamW: no DeepSpeed, no data loader.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `python benchmarks/analysis/step_ops.py` finds common

from benchmarks.common import SPECIAL_IDS, VOCAB, electra_config_for, three_documents_per_sample  # noqa: E402
from convbert_ds.cli import ArgumentParser, bounded, exit_on_user_error  # noqa: E402
from convbert_ds.config import PRESET_NAMES  # noqa: E402
from convbert_ds.model import ElectraForPretraining  # noqa: E402


def profile_step(model, optimizer, inputs: dict, steps: int, cuda: bool):
    def step():
        with torch.autocast("cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=cuda):
            loss = model(**inputs, check=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities, record_shapes=True) as profile:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    return profile


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=PRESET_NAMES, default=None, help="default: base on CUDA, tiny on CPU")
    parser.add_argument("--batch", type=bounded(int, min=1), default=None, help="default: 128 on CUDA, 2 on CPU")
    parser.add_argument("--seq", type=bounded(int, min=8), default=None, help="default: 128 on CUDA, 32 on CPU")
    parser.add_argument("--steps", type=bounded(int, min=1), default=2, help="profiled steps per row")
    parser.add_argument("--top", type=bounded(int, min=1), default=14, help="ops listed per row")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    name, batch, seq = args.preset or ("base" if cuda else "tiny"), args.batch or (128 if cuda else 2), \
        args.seq or (128 if cuda else 32)
    config = electra_config_for(name, VOCAB, SPECIAL_IDS, max_position_embeddings=max(512, seq),
                                sdconv_impl="triton" if cuda else "torch")
    torch.manual_seed(0)
    model = ElectraForPretraining(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    input_ids = torch.randint(5, VOCAB, (batch, seq), device=device)
    one_document = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
                    "token_type_ids": torch.zeros_like(input_ids)}
    thirds = three_documents_per_sample(batch, seq, device)
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    per_step = {}
    print(f"device={torch.cuda.get_device_name() if cuda else 'cpu'} preset={name} batch={batch} seq={seq} "
          f"precision={'bf16 autocast' if cuda else 'fp32'} profiled steps={args.steps}")
    for row, inputs in (("one document per sample", one_document),
                        ("packed: 3 documents per sample", {**one_document, "document_ids": thirds})):
        profile = profile_step(model, optimizer, inputs, args.steps, cuda)
        averages = profile.key_averages(group_by_input_shape=True)
        total = sum(getattr(e, key.replace("cuda", "device")) for e in averages
                    if not cuda or (e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation))
        per_step[row] = total / 1e3 / args.steps
        print(f"\n{row}: {per_step[row]:.1f} ms/step of {'device' if cuda else 'host'} time")
        print(averages.table(sort_by=key, row_limit=args.top, max_name_column_width=60, max_shapes_column_width=90))
    (_, first), (_, packed) = per_step.items()
    print(f"packed / one document: {packed / first:.2f} (time per step)")


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
