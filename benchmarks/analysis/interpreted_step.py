"""The compiled ELECTRA step with the kernels inductor builds for a GPU, run on a CPU by Triton's interpreter,
and every gradient against eager's: whether an inductor option a GPU lease would A/B (``train.compile_options``,
e.g. combo kernels) still computes the model, checked before a lease spends its minutes on the option's speed.

    TRITON_INTERPRET=1 python benchmarks/analysis/interpreted_step.py                              # no option
    TRITON_INTERPRET=1 python benchmarks/analysis/interpreted_step.py --option combo_kernels=true  # as the configs
    TRITON_INTERPRET=1 python benchmarks/analysis/interpreted_step.py --ffn --autotune matmuls     # the FFN

Why: a GPU's compiled step runs Triton kernels that no CPU compile builds (a CPU gets C++ kernels, grouped
otherwise), so the CPU tests of the compiled step never run them, and an option that changes only them (combo
kernels join independent kernels into one launch, each part indexing its own slice) is checked nowhere before
a lease. Here inductor builds the GPU's kernels for CPU tensors (``gpu_kernels.
gpu_kernels_built_for_cpu_tensors``: the GPU's fusion, configurations and combo kernels), the SDConv runs as
on CUDA (its Triton custom ops, the packed conv through inductor), and Triton's interpreter runs every kernel,
program by program, in numpy: about a minute for the tiny model's step (one layer a body, one sample of 32
tokens from three documents; dropout on, the draws eager's). ``--ffn``: the feed-forward block alone at a
``train.compile_autotune`` level, with the kernels its step runs (``check_ffn``: whether the GELU goes into
the matmul templates' epilogues).

What it does not check: a GPU's arithmetic (the interpreter's is numpy's, in fp32 or, with ``--bf16``, under
bf16 autocast; a GPU's bf16 instructions and fast math are its own), its launches (no CUDA graphs, no PDL),
and libdevice's functions, which the interpreter lacks and which are given here by Triton's own math
(``_libdevice_interpreted``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `python benchmarks/analysis/interpreted_step.py`

from benchmarks.analysis.gpu_kernels import (  # noqa: E402
    attributes_set, gpu_kernels_built_for_cpu_tensors, launches_recorded, sdconv_as_on_cuda)
from benchmarks.common import SPECIAL_IDS, electra_config_for, three_documents_per_sample  # noqa: E402
from convbert_ds.cli import ArgumentParser, bounded, exit_on_user_error  # noqa: E402
from convbert_ds.engine.compile_options import inductor_options  # noqa: E402
from convbert_ds.errors import UserError  # noqa: E402
from convbert_ds.formats.train_config import load_config, option_text  # noqa: E402

if TYPE_CHECKING:  # the model is imported where it runs, after _require_the_interpreter
    from convbert_ds.model.layers import AutotuneLevel

SEQ, VOCAB = 32, 128  # the head's softmax over the vocabulary was a third of the interpreter's time at 1,000
# The keys' biases have a true gradient of zero (the softmax ignores a shift of every score of a query alike):
# what they get is rounding, and a relative error of rounding means nothing.
ROUNDING_ONLY = "self.key.bias"


def _libdevice_interpreted() -> dict:
    """libdevice's functions that inductor's kernels call, in Triton's own math, which the interpreter runs:
    it has no libdevice (its stubs return None, which surfaces as an error about a dtype far from the call)."""
    import triton.language as tl

    def nearbyint(x):  # rounds half to even, as libdevice's and torch.round do
        nearest = tl.math.floor(x + 0.5)
        odd = nearest - 2.0 * tl.math.floor(nearest * 0.5) != 0.0
        return tl.where((nearest - x == 0.5) & odd, nearest - 1.0, nearest)

    return {"erf": lambda x: tl.math.erf(x), "exp": lambda x: tl.math.exp(x), "exp2": lambda x: tl.math.exp2(x),
            "log": lambda x: tl.math.log(x), "log2": lambda x: tl.math.log2(x),
            "log1p": lambda x: tl.math.log(x + 1.0),  # not to the last bit where |x| << 1
            "expm1": lambda x: tl.math.exp(x) - 1.0, "sqrt": lambda x: tl.math.sqrt(x),
            "rsqrt": lambda x: tl.math.rsqrt(x), "abs": lambda x: tl.math.abs(x),
            "floor": lambda x: tl.math.floor(x), "ceil": lambda x: tl.math.ceil(x),
            "tanh": lambda x: 2.0 * tl.sigmoid(2.0 * x) - 1.0, "nearbyint": nearbyint,
            "isnan": lambda x: x != x, "isinf": lambda x: tl.math.abs(x) == float("inf")}


def _require_the_interpreter() -> None:
    if not os.environ.get("TRITON_INTERPRET"):
        raise UserError("the kernels run in Triton's interpreter: set TRITON_INTERPRET=1 before python starts "
                        "(TRITON_INTERPRET=1 python benchmarks/analysis/interpreted_step.py)")


@contextlib.contextmanager
def gpu_kernels_interpreted():
    """Inside, inductor builds for CPU tensors the Triton kernels it would build for a GPU and Triton's
    interpreter runs them (``TRITON_INTERPRET=1``, set before triton is imported). Every libdevice function
    that ``_libdevice_interpreted`` does not give raises, naming itself. The interpreter's warnings of its
    masked-off lanes (a division by the zero a masked load reads) are silenced."""
    _require_the_interpreter()
    import triton.language.extra.libdevice as libdevice

    given = _libdevice_interpreted()

    def missing(name):
        def call(*args, **kwargs):
            raise NotImplementedError(f"libdevice.{name} has no interpreted form: add one to "
                                      "benchmarks/analysis/interpreted_step.py's _libdevice_interpreted")
        return call

    functions = [name for name in dir(libdevice) if not name.startswith("_") and callable(getattr(libdevice, name))]
    patches = tuple((libdevice, name, given.get(name) or missing(name)) for name in functions)
    with gpu_kernels_built_for_cpu_tensors("interpreted", patches), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")
        yield


@dataclass(frozen=True)
class StepCheck:
    launches: int  # of inductor's Triton kernels in the compiled step's forward and backward
    seconds: float  # the compiled step's first call: its compile, and the interpreter running it
    eager_loss: float
    compiled_loss: float
    worst: list[tuple[float, str]]  # the largest relative gradient errors, largest first: (error, parameter)
    compared: int  # parameters whose gradients were compared


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def check_step(options: dict, layers: int = 1, bf16: bool = False, worst: int = 5,
               autotune: AutotuneLevel = False) -> StepCheck:
    """One training step of the tiny model, eager and then compiled (``compile_step``, inductor's ``options``,
    checked, and ``train.compile_autotune``'s level) with the GPU's kernels interpreted, from the same weights
    and draws; each gradient's relative error against eager's (``worst``: how many of the largest are kept).
    ``bf16``: both under bf16 autocast with the residual stream in bf16, as the paper configs run on a GPU."""
    _require_the_interpreter()  # before the eager step, whose SDConv is already Triton's
    from convbert_ds.model import ElectraForPretraining
    from convbert_ds.model.layers import compile_step

    config = electra_config_for("tiny", VOCAB, SPECIAL_IDS, max_position_embeddings=SEQ, num_hidden_layers=layers,
                                sdconv_impl="auto", residual_dtype="autocast" if bf16 else "fp32")
    torch.manual_seed(0)
    model = ElectraForPretraining(config)
    ids = torch.randint(5, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=torch.zeros_like(ids),
                  document_ids=three_documents_per_sample(1, SEQ, ids.device))

    def step() -> tuple[float, dict[str, torch.Tensor]]:
        torch.manual_seed(7)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(**inputs, check=False).loss
        loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return loss.item(), grads

    with attributes_set(sdconv_as_on_cuda()):
        eager_loss, eager = step()
        torch._dynamo.reset()
        with gpu_kernels_interpreted(), launches_recorded(also_run=True) as launches:
            compile_step(model, cuda_graphs=False, autotune=autotune, options=options)
            start = time.perf_counter()
            compiled_loss, compiled = step()
            seconds = time.perf_counter() - start
    torch._dynamo.reset()  # nothing compiled here is called again outside
    if compiled.keys() != eager.keys():
        raise RuntimeError(f"the compiled step gave gradients to other parameters: "
                           f"{sorted(compiled.keys() ^ eager.keys())[:5]}")
    errors = sorted(((_relative(compiled[name], grad), name) for name, grad in eager.items()
                     if not name.endswith(ROUNDING_ONLY)), reverse=True)
    return StepCheck(len(launches), seconds, eager_loss, compiled_loss, errors[:worst], len(errors))


# Where the interpreter cannot stand in for a GPU's choice of matmul, these make it: a Triton template for
# every matmul (on a GPU each is timed against cuBLAS; here numpy's templates would lose every time), one
# configuration each (the interpreter times each one, ~0.6 s), and the template's epilogue fused without
# timing the fusion (its timing source cannot be built for CPU tensors).
TEMPLATES_CHOSEN = {"max_autotune_gemm_backends": "TRITON", "test_configs.max_mm_configs": 1,
                    "benchmark_epilogue_fusion": False}
FFN_ROWS = 16


@dataclass(frozen=True)
class FfnCheck:
    kernels: list[str]  # inductor's Triton kernels that the compiled FFN's step ran, in order
    worst: float  # the largest relative error of a gradient (the input's, each weight's) against eager's


def check_ffn(autotune: AutotuneLevel, options: dict | None = None) -> FfnCheck:
    """The tiny model's feed-forward block alone (``ConvBertIntermediate``: matmul, GELU; ``ConvBertOutput``:
    matmul, residual, LayerNorm), in eval mode (no dropout), compiled at ``train.compile_autotune``'s level
    (and inductor's ``options``, checked) with the GPU's kernels interpreted; the matmul templates chosen
    (``TEMPLATES_CHOSEN``) where the level has them. Which kernels its step runs once compiled and tuned, and
    its gradients against eager's: whether the GELU and its backward go into the matmuls' epilogues, where
    only the level ``matmuls`` (or ``true``) can put them."""
    from convbert_ds.config import preset
    from convbert_ds.model.layers import ConvBertIntermediate, ConvBertOutput, step_inductor_options

    class Ffn(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.intermediate, self.output = ConvBertIntermediate(config), ConvBertOutput(config)

        def forward(self, x):
            return self.output(self.intermediate(x), x)

    config = preset("tiny")
    torch.manual_seed(0)
    ffn = Ffn(config).eval()
    x = torch.randn(FFN_ROWS, config.hidden_size, requires_grad=True)
    weights = torch.randn(FFN_ROWS, config.hidden_size)  # a loss whose gradient is not the same everywhere

    def step(forward) -> list[torch.Tensor]:
        x.grad = None
        ffn.zero_grad(set_to_none=True)
        (forward(x) * weights).sum().backward()
        return [x.grad.clone(), *(p.grad.clone() for p in ffn.parameters())]

    eager = step(ffn)
    level = step_inductor_options(cuda_graphs=False, layers_once=False, autotune=autotune, eager_random=True)
    options = {**level, **(options or {})}
    if options.get("max_autotune_gemm") or options.get("max_autotune"):
        options.update(TEMPLATES_CHOSEN)
    torch._dynamo.reset()
    with gpu_kernels_interpreted():
        compiled = torch.compile(ffn, fullgraph=True, dynamic=False, options=options)
        step(compiled)  # compiles, and tunes what the level tunes
        with launches_recorded(also_run=True) as launches:
            grads = step(compiled)
    torch._dynamo.reset()
    return FfnCheck(list(launches), max(map(_relative, grads, eager)))


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="one of inductor's options, as train.compile_options takes it (e.g. combo_kernels=true); "
                             "repeatable")
    parser.add_argument("--autotune", default="false", metavar="LEVEL",
                        help="train.compile_autotune's level: false, kernels, matmuls or true (default: false)")
    parser.add_argument("--ffn", action="store_true",
                        help="the feed-forward block alone (check_ffn), at --autotune's level with any --option: "
                             "the kernels its step runs, and its gradients against eager's (fp32)")
    parser.add_argument("--layers", type=bounded(int, min=1), default=1, help="layers a body (the tiny model's: 2)")
    parser.add_argument("--bf16", action="store_true",
                        help="under bf16 autocast, the residual stream in bf16, as the paper configs on a GPU")
    parser.add_argument("--tolerance", type=bounded(float, min=0.0), default=None,
                        help="the largest relative error of a gradient against eager's that passes (default: 1e-4 "
                             "in fp32; 0.1 in bf16, where eager rounds each op's result to bf16 and inductor's "
                             "fused kernels keep fp32 between their ops: 0.047 measured, combo kernels or not; "
                             "--ffn: 1e-5)")
    args = parser.parse_args(argv)
    if args.ffn and (args.bf16 or args.layers != 1):
        parser.error("--ffn checks the feed-forward block alone, in fp32: drop --layers and --bf16")
    tolerance = args.tolerance if args.tolerance is not None else 1e-5 if args.ffn else 0.1 if args.bf16 else 1e-4
    loss_tolerance = 1e-3 if args.bf16 else 1e-5
    # The options checked as the trainer checks train.compile_options, before any compile.
    cfg = load_config(None, ["train.compile_mode=step", f"train.compile_autotune={args.autotune}",
                             *(f"train.compile_options.{text}" for text in args.option)])
    options = inductor_options(cfg)
    given = "".join(f", inductor {option_text(k, v)}" for k, v in options.items())
    if args.ffn:
        _print_ffn(check_ffn(cfg.train.compile_autotune, options), f"train.compile_autotune={args.autotune}{given}",
                   tolerance)
        return
    check = check_step(options, args.layers, args.bf16, autotune=cfg.train.compile_autotune)
    precision = "bf16 autocast" if args.bf16 else "fp32"
    level = f", train.compile_autotune={args.autotune}" if cfg.train.compile_autotune else ""
    print(f"the tiny step (1 x {SEQ}, {args.layers} layer(s) a body, {precision}), inductor's GPU kernels in Triton's "
          f"interpreter{level}{given} | torch {torch.__version__}")
    print(f"kernels launched: {check.launches:,}; first call {check.seconds:.0f} s (compile and interpreter)")
    print(f"loss: eager {check.eager_loss:.8f}, compiled {check.compiled_loss:.8f}")
    print(f"largest relative gradient errors against eager ({check.compared} parameters compared):")
    for error, name in check.worst:
        print(f"  {error:9.2e}  {name}")
    _verdict(check.worst[0][0] > tolerance
             or abs(check.compiled_loss - check.eager_loss) > loss_tolerance * abs(check.eager_loss),
             f"tolerance {tolerance:g} a gradient, {loss_tolerance:g} the loss")


def _print_ffn(check: FfnCheck, setting: str, tolerance: float) -> None:
    """``setting``: the level, then any of inductor's options given, as the header says them."""
    print(f"the tiny model's feed-forward block ({FFN_ROWS} rows, fp32, eval), {setting}, "
          f"inductor's GPU kernels in Triton's interpreter | torch {torch.__version__}")
    print(f"kernels its step runs ({len(check.kernels)}):")
    for name in check.kernels:
        print(f"  {name}")
    print(f"largest relative gradient error against eager: {check.worst:.2e}")
    _verdict(check.worst > tolerance, f"tolerance {tolerance:g}")


def _verdict(off: bool, tolerances: str) -> None:
    """The last line either check prints; off a tolerance, exit 1."""
    print(f"{'FAILED' if off else 'passed'}: {tolerances}")
    if off:
        raise SystemExit(1)


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
