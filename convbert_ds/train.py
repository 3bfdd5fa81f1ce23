"""Pretrain ConvBERT (ELECTRA or MLM) with DeepSpeed: ZeRO 0-3 or pipeline parallelism.

    deepspeed --num_gpus 8 --module convbert_ds.train --config CONFIG.yaml [key=value ...]
    torchrun --nproc_per_node 8 -m convbert_ds.train --config CONFIG.yaml ...
    srun python -m convbert_ds.train --config CONFIG.yaml ...      (ranks from SLURM_*)
    mpirun -np 8 python -m convbert_ds.train --config CONFIG.yaml ... (ranks from MPI)

Rerunning the same command resumes from the newest complete checkpoint.
SIGUSR1/SIGTERM: the current step finishes, a checkpoint is saved, and the
process exits with code 3 (``EXIT_PREEMPTED``) so a job script can requeue; before the first step has
ended (waiting for peers, downloading, compiling) SIGUSR1, SIGTERM and SIGINT stop it at once, with code 3
and nothing to save. A rank whose peer is gone
(a killed process, a dead node) says so in one line and exits with code 5 (``distributed.EXIT_PEER_LOST``).

    python -m convbert_ds.train --config CONFIG.yaml [key=value ...] --check-config [--world-size N]
    python -m convbert_ds.train --config CONFIG.yaml [key=value ...] --print-config

check the config as the trainer will for N processes (exit 0, or 2 with one line), or print it resolved,
without starting anything or writing anywhere (a run first fetches, verifies and opens what it reads:
``convbert_ds.engine.prepare``). The loop itself is ``convbert_ds.engine.trainer``.
"""

from __future__ import annotations

import os
import signal


def _stopped_while_importing(signum, frame):
    """Until ``main`` takes the signals over (``Preemption``): the imports below take seconds, and a signal's
    default action would end the process without a word (SIGINT: a traceback)."""
    os.write(2, f"received {signal.Signals(signum).name}: stopped before training started: nothing to save\n"
             .encode())
    os._exit(3)  # EXIT_PREEMPTED, whose module is not imported yet


if __name__ == "__main__":  # a trainer process; a program importing this module keeps its own handlers
    for _signal in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        signal.signal(_signal, _stopped_while_importing)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import warnings  # noqa: E402

import torch.distributed as dist  # noqa: E402

from convbert_ds.engine import distributed  # noqa: E402
from convbert_ds.engine.plan import RunPlan, build_ds_config, host_sync_warnings, resolve  # noqa: E402
from convbert_ds.engine.prepare import check_shards, prepare  # noqa: E402
from convbert_ds.formats.train_config import describe_keys, load_config, option_text  # noqa: E402
from convbert_ds.engine.trainer import EXIT_PREEMPTED, Preemption, Trainer, TrainingError  # noqa: E402
from convbert_ds.cli import ArgumentParser, bounded  # noqa: E402
from convbert_ds.errors import EXIT_USER_ERROR, UserError  # noqa: E402
from convbert_ds.log import EVERY_RANK, get_logger  # noqa: E402

log = get_logger(__name__)

__all__ = ["EXIT_PREEMPTED", "Preemption", "RunPlan", "Trainer", "TrainingError", "build_ds_config", "main"]


def parse_args(argv):
    parser = ArgumentParser(
        prog="python -m convbert_ds.train", description=__doc__.split("\n\n")[0],
        epilog="config keys (set them in CONFIG or as key=value):\n" + "\n".join(describe_keys()))
    parser.add_argument("--config", help="YAML/JSON training config (default: every key at its default)")
    parser.add_argument("--check-config", action="store_true",
                        help="validate CONFIG + overrides for --world-size processes, start nothing")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as JSON, start nothing")
    parser.add_argument("--world-size", type=bounded(int, min=1), default=None,
                        help="processes to check for (default: as the launcher's environment says)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=100")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    for sig, default in ((signal.SIGUSR1, signal.SIG_DFL), (signal.SIGTERM, signal.SIG_DFL),
                         (signal.SIGINT, signal.default_int_handler)):  # Preemption restores these when it is done
        if signal.getsignal(sig) is _stopped_while_importing:
            signal.signal(sig, default)
    preemption = Preemption()  # first: a signal before the first step ends stops the process at once
    try:
        return _run(argv, preemption)
    finally:
        preemption.close()


def _run(argv: list[str] | None, preemption: Preemption) -> int:
    # DeepSpeed calls torch.distributed APIs that torch marks deprecated, once per step.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    restore = distributed.saved_torch_vars()  # put back when nothing starts (a caller in this process)
    where = ""
    try:
        launcher = distributed.discover()  # the rank variables, checked
        args = parse_args(argv)
        world_size = args.world_size or distributed.world_size()
        where = f" ({world_size} processes)" if args.check_config else ""
        plan = resolve(load_config(args.config, args.overrides), world_size)
        if args.check_config:
            check_shards(plan)  # a bit flip found before the job queues; nothing written
        elif not args.print_config:
            plan = prepare(plan)  # a run's downloads, checksums and opened splits; a check writes nothing
    except UserError as error:
        # Before any process group: every rank has the same one line, rank 0's is enough; a rank variable may
        # be wrong on one rank alone, so there each rank says its own.
        launch = isinstance(error, distributed.LaunchError)
        log.error(f"config error{where}: {error}", extra=EVERY_RANK if launch else None)
        restore()
        return EXIT_USER_ERROR
    cfg = plan.cfg
    if not plan.has_valid and cfg.eval.interval and cfg.eval.samples:
        # Degrades the run without stopping it: say so at start, not by an absence of eval lines hours later.
        log.warning("warning: not every data.sets directory has a validation split, so evaluation is off; shard "
                    "with --valid-fraction 0.01 to get one, or set eval.interval=0 to silence this")
    for line in host_sync_warnings(plan.ds_config):
        log.warning(f"warning: {line}")
    note = plan.lr_schedule.note(cfg.train.warmup_steps)  # the warm-up that runs, where it is not the one asked
    if note and not args.print_config:  # stdout stays the JSON (lr_schedule in it says the same)
        log.info(note)
    if args.print_config:
        print(json.dumps(dataclasses.asdict(plan), indent=2, default=str))
    compiled = cfg.train.compile_mode if cfg.train.compile else "off"
    if compiled == "step":
        compiled += "+layers_once" * cfg.train.compile_layers_once
        level = cfg.train.compile_autotune
        compiled += "" if level is False else "+autotune" if level is True else f"+autotune_{level}"
    if compiled != "off":
        compiled += "+inductor_random" * (cfg.train.compile_random == "inductor")
        compiled += "".join(f"+{option_text(name, value)}" for name, value in sorted(plan.compile_options.items()))
    # train.cuda_graphs=auto says what it chose, and why when that is not a capture by hand.
    graphs = f"cuda_graphs={plan.cuda_graphs}" + (f" (auto: {plan.cuda_graphs_why} cannot be captured)"
                                                  if plan.cuda_graphs_why else "")
    if args.check_config:
        print(f"config valid for {world_size} processes: precision={plan.precision} zero_stage={plan.zero_stage} "
              f"pipeline_stages={cfg.pipeline.stages} grad_accum={plan.grad_accum} compile={compiled} {graphs}")
        print(f"checkpoint_dir={cfg.checkpoint.dir}")  # the lines the Slurm scripts read
        print(f"checkpoint_mirror={cfg.checkpoint.mirror or ''}")
    if args.print_config or args.check_config:
        restore()
        return 0
    trainer = Trainer(plan)
    distributed.place()  # LOCAL_RANK's GPU, then the process group
    backend = dist.get_backend()
    log.info(f"launcher={launcher} world_size={dist.get_world_size()} backend={backend} "
             f"precision={plan.precision} zero_stage={plan.zero_stage} "
             f"pipeline_stages={cfg.pipeline.stages} grad_accum={plan.grad_accum} compile={compiled} {graphs}")
    if cfg.train.compile:  # otherwise minutes of silence before the first log line look like a hang
        # The whole step compiles for training only (evaluation runs eager); layers compile in both modes.
        what = ("the first step compiles" if cfg.train.compile_mode == "step"
                else "the first step and the first evaluation compile")
        log.info(f"note: train.compile=true: {what} the model first "
                 f"(compile_mode={compiled}: about 2 minutes for ConvBERT-base on a GPU); train.compile=false "
                 "starts at once, slower per step")
    try:
        trainer.setup()
        code = trainer.train(preemption)
    except UserError as error:
        # Found after the start (a damaged or unsafe checkpoint file, a checkpoint that cannot change layout):
        # every rank reads the same files and stops alike; rank 0's line is the one to read.
        log.error(f"error: {error}")
        return EXIT_USER_ERROR
    except RuntimeError as error:
        said = distributed.lost_peer(error)  # a killed rank or a dead node: one line on each rank that is left
        if said is None:
            raise
        log.error(said, extra=EVERY_RANK)
        return distributed.EXIT_PEER_LOST
    if code == 0:
        where = trainer.ckpt_dir if trainer.disk.shared else cfg.checkpoint.mirror  # node-local: whole only there
        log.info(f"done: {trainer.step} steps; checkpoints in {where}; logs in {cfg.log_dir}")
    distributed.leave_together()
    return code


if __name__ == "__main__":
    distributed.exit_process(main())
