"""The contract between convbert_ds and the DeepSpeed that requirements.txt pins: every internal that
``convbert_ds/engine/deepspeed_seam.py`` declares (what we patch, set, call or read beyond DeepSpeed's
documented API) is there.

- on DeepSpeed's classes and modules: methods, class and module attributes, and every owner class itself;
- on real engines of every kind the trainer builds (ZeRO 0-3, fp32 and bf16, the pipeline engine after one
  ``train_batch``), one gloo rank in a process of its own: the attributes DeepSpeed sets on an instance, or
  on each model parameter;
- that the checks can fail: a copy of an owner without one attribute (a DeepSpeed that renamed it) is named,
  and the seam's functions raise ``DeepSpeedMismatch`` naming the attribute and the version, changing nothing;
- that the list is the truth: each declaration's module still uses its attribute, and no module touches a
  private (or the seam's own) DeepSpeed attribute without a declaration naming it.
"""

from __future__ import annotations

import io
import json
import re
import tokenize
import types

import pytest

from launch import REPO, TINY_CONFIG, run_as_one_rank

from convbert_ds.engine import deepspeed_seam as seam
from convbert_ds.errors import UserError

PACKAGE = REPO / "convbert_ds"
ON_INSTANCES = [i for i in seam.INTERNALS if i.on != "class"]
ON_CLASSES = [i for i in seam.INTERNALS if i.on == "class"]


def test_the_installed_deepspeed_is_the_pinned_one_the_seam_was_checked_with():
    pinned = re.search(r"^deepspeed==(\S+)$", (REPO / "requirements.txt").read_text(), re.M).group(1)
    assert seam.TESTED_WITH == pinned
    assert seam.deepspeed_version() == pinned, "this file checks the pinned DeepSpeed: install requirements.txt"


def test_every_internal_is_there_on_deepspeeds_classes():
    missing = seam.missing_on_classes()
    assert not missing, "\n".join(missing)


def _without(owner, attribute: str):
    """A copy of ``owner`` (a class or module) that has everything it has but ``attribute``: DeepSpeed after a
    rename."""
    kept = {name: getattr(owner, name) for name in dir(owner)
            if name != attribute and not (name.startswith("__") and name.endswith("__"))}
    return types.SimpleNamespace(**kept)


@pytest.mark.parametrize("internal", ON_CLASSES, ids=lambda i: i.name)
def test_the_class_check_names_a_renamed_attribute(internal):
    renamed = _without(seam.resolve(internal.owner), internal.attribute)
    missing = seam.missing_on_classes(resolve=lambda owner: renamed if owner == internal.owner else seam.resolve(owner))
    assert missing == [line for line in missing if internal.name in line] and len(missing) == 1, missing
    assert f"DeepSpeed {seam.deepspeed_version()} has no {internal.name}" in missing[0]
    assert f"convbert_ds/{internal.where}" in missing[0]


def test_a_missing_owner_class_is_named():
    internal = next(i for i in ON_INSTANCES if i.attribute == "fwd_outputs")
    missing = seam.missing_on_classes([internal], resolve=lambda owner: None)
    assert len(missing) == 1 and f"has no {internal.owner} (" in missing[0], missing


# The seam's functions fail loudly --------------------------------------------------------------------


class TorchCheckpointEngine:  # DeepSpeed's, as if its makedirs had been renamed
    def save(self, state_dict, path):
        raise AssertionError("not called")


class DeepSpeedEngine:
    def __init__(self, checkpoint_engine):
        self.checkpoint_engine = checkpoint_engine

    def _copy_recovery_script(self, save_path):
        raise AssertionError("not called")


def test_routing_a_save_through_a_deepspeed_without_an_attribute_fails_naming_it_and_changes_nothing():
    checkpoint_engine = TorchCheckpointEngine()
    engine = DeepSpeedEngine(checkpoint_engine)
    with pytest.raises(seam.DeepSpeedMismatch) as error:
        with seam.route_checkpoint_writes(engine, lambda write, *args: None):
            raise AssertionError("the block ran without DeepSpeed's makedirs routed")
    message = str(error.value)
    assert message.startswith(f"DeepSpeed {seam.deepspeed_version()} has no TorchCheckpointEngine.makedirs "), message
    assert f"tested with DeepSpeed {seam.TESTED_WITH}" in message and "\n" not in message
    assert isinstance(error.value, UserError)  # one line and exit 2 from the trainer, on every rank alike
    assert vars(checkpoint_engine) == {} and set(vars(engine)) == {"checkpoint_engine"}  # nothing half-routed
    with pytest.raises(seam.DeepSpeedMismatch, match="TorchCheckpointEngine.makedirs"):
        seam.check_checkpoint_writes(engine)


def test_a_routed_save_goes_through_and_is_undone_even_when_it_fails():
    class Complete(TorchCheckpointEngine):
        def makedirs(self, path, exist_ok=False):
            raise AssertionError("not called")

    checkpoint_engine, seen = Complete(), []
    engine = DeepSpeedEngine(checkpoint_engine)
    with pytest.raises(OSError, match="disk full"):
        with seam.route_checkpoint_writes(engine, lambda write, *args: seen.append((write, args)),
                                          save=lambda state_dict, path: None):
            checkpoint_engine.makedirs("tag")
            checkpoint_engine.save({"w": 1}, "tag/file.pt")
            engine._copy_recovery_script("tag")
            raise OSError("disk full")
    assert [args for _, args in seen] == [("tag",), ({"w": 1}, "tag/file.pt"), ("tag",)]
    assert seen[0][0].__func__ is Complete.makedirs and seen[1][0].__name__ == "<lambda>"  # save: the stand-in
    assert seen[2][0].__func__ is DeepSpeedEngine._copy_recovery_script
    assert vars(checkpoint_engine) == {} and set(vars(engine)) == {"checkpoint_engine"}


def test_the_instance_check_names_what_an_object_lacks():
    engine = DeepSpeedEngine(TorchCheckpointEngine())  # has checkpoint_engine, none of the others

    def resolve(owner):
        return DeepSpeedEngine if owner.endswith(".DeepSpeedEngine") else seam.resolve(owner)

    missing, checked = seam.missing_on(engine, resolve=resolve)
    declared = {i.attribute for i in ON_INSTANCES if i.owner.endswith(".DeepSpeedEngine")}
    assert {i.attribute for i in checked} == declared and "enable_backward_allreduce" in declared
    assert sorted(missing) == sorted(f"DeepSpeed {seam.deepspeed_version()} has no DeepSpeedEngine.{i.attribute} "
                                     f"({i.owner}.{i.attribute}, {i.use} by convbert_ds/{i.where}: {i.why})"
                                     for i in checked if i.attribute != "checkpoint_engine")

    class DeepSpeedZeroOptimizer_Stage3:  # noqa: N801 - DeepSpeed's name
        pass

    params = [types.SimpleNamespace(ds_id=0), types.SimpleNamespace()]  # the second as if ds_id were renamed
    missing, checked = seam.missing_on(DeepSpeedZeroOptimizer_Stage3(), parameters=params, resolve=lambda owner: (
        DeepSpeedZeroOptimizer_Stage3 if owner.endswith(".DeepSpeedZeroOptimizer_Stage3") else seam.resolve(owner)))
    assert [line for line in missing if "ds_id" in line] == [
        line for line in missing if "has no DeepSpeedZeroOptimizer_Stage3.ds_id on its parameters" in line] != []


def test_the_step_functions_fail_naming_what_is_missing():
    with pytest.raises(seam.DeepSpeedMismatch, match=r"has no DeepSpeedEngine\.enable_backward_allreduce "):
        seam.turn_off_backward_allreduce(DeepSpeedEngine(None))
    engine = DeepSpeedEngine(None)
    engine.allreduce_bucket, engine.unflatten = (lambda grads, group: grads), (lambda flat, grads: grads)
    with pytest.raises(seam.DeepSpeedMismatch, match=r"has no DeepSpeedEngine\.seq_data_parallel_group "):
        seam.gradient_allreduce(engine)


# The list is the truth -------------------------------------------------------------------------------


def _attributes_used(source: str) -> set[str]:
    """The names this code reads as ``.name`` (not in strings or comments)."""
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
              if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE)]
    return {b.string for a, b in zip(tokens, tokens[1:]) if a.string == "." and b.type == tokenize.NAME}


@pytest.mark.parametrize("internal", [i for i in seam.INTERNALS if i.where != seam.SEAM], ids=lambda i: i.name)
def test_each_declared_use_is_still_in_its_module(internal):
    assert internal.attribute in (PACKAGE / internal.where).read_text(), \
        f"{internal.name}: convbert_ds/{internal.where} no longer uses it; update deepspeed_seam.INTERNALS"


def test_no_module_touches_a_private_deepspeed_attribute_without_a_declaration_naming_it():
    """The names that can only be DeepSpeed's: its private ones we declare, and the seam's own."""
    watched = {i.attribute for i in seam.INTERNALS
               if (i.attribute.startswith("_") and not i.attribute.startswith("__"))
               or (i.where == seam.SEAM and "_" in i.attribute)}
    undeclared = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        for attribute in _attributes_used(path.read_text()) & watched:
            if not any(i.attribute == attribute and i.where == where for i in seam.INTERNALS):
                undeclared.append(f"convbert_ds/{where}: .{attribute}")
    assert not undeclared, f"use them through deepspeed_seam, or declare them there: {undeclared}"


# Real engines ----------------------------------------------------------------------------------------


def _engines():
    """(label, engine) for every kind of engine and optimizer the trainer builds on CPU, one rank."""
    import deepspeed
    import torch

    from convbert_ds.config import ElectraConfig
    from convbert_ds.engine.pipeline import build_pipeline_module, pipeline_batch
    from convbert_ds.engine.plan import build_ds_config, load_ds_config, precision_of
    from convbert_ds.formats.train_config import load_config
    from convbert_ds.model import ElectraForPretraining
    from convbert_ds.model.optim import param_groups

    def ds_config(name: str, *extra: str) -> dict:
        cfg = load_config(TINY_CONFIG, [f"deepspeed.config=ds_configs/{name}.json", "train.precision=null",
                                        "train.micro_batch_size=2", "train.global_batch_size=2", *extra])
        base = load_ds_config(cfg)
        return build_ds_config(cfg, base, 2, 1, precision_of(cfg, base))

    electra = ElectraConfig.from_preset("tiny", vocab_size=1000, max_position_embeddings=64)
    # bf16 ZeRO-1 with fp32 gradient accumulation: DeepSpeed's BF16_Optimizer
    kinds = {"zero0_fp32": ds_config("zero0_fp32"), "zero0_bf16": ds_config("zero0_bf16"),
             "zero1_bf16": ds_config("zero1_bf16"), "zero3_bf16": ds_config("zero3_bf16"),
             "zero1_bf16_fp32_accumulation": {**ds_config("zero1_bf16"), "data_types": {"grad_accum_dtype": "fp32"}}}
    for label, ds in kinds.items():
        torch.manual_seed(0)
        model = ElectraForPretraining(electra)
        yield label, deepspeed.initialize(model=model, model_parameters=param_groups(model, 0.01), config=ds)[0]
    module = build_pipeline_module(electra, 1)
    engine = deepspeed.initialize(model=module, model_parameters=[p for p in module.parameters() if p.requires_grad],
                                  config=ds_config("pipeline_zero1_bf16", "pipeline.stages=1"))[0]
    ids = torch.randint(5, 1000, (2, 64))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
    engine.train_batch(data_iter=iter([pipeline_batch(batch)]))  # fwd_outputs exists once a schedule ran
    yield "pipeline_zero1_bf16", engine


def _check_engines() -> dict:
    from convbert_ds.engine.distributed import init_process_group

    init_process_group("gloo")
    missing, checked, kinds = [], set(), {}
    for label, engine in _engines():
        kinds[label] = [type(engine).__name__, type(engine.optimizer).__name__]
        params = [p for p in engine.module.parameters() if p.requires_grad]
        for obj in (engine, engine.checkpoint_engine, engine.optimizer, engine.module):
            found, seen = seam.missing_on(obj, parameters=params if obj is engine.optimizer else ())
            missing += [f"{label}: {line}" for line in found]
            checked |= {(i.owner, i.attribute, i.on) for i in seen}
    return {"missing": missing, "checked": sorted(checked), "kinds": kinds}


@pytest.fixture(scope="module")
def engines():
    return run_as_one_rank(__file__)


@pytest.mark.slow
def test_every_internal_is_there_on_real_engines(engines):
    assert not engines["missing"], "\n".join(engines["missing"])


@pytest.mark.slow
def test_every_instance_internal_was_checked_on_a_real_object(engines):
    checked = {tuple(entry) for entry in engines["checked"]}
    unchecked = [i.name for i in ON_INSTANCES if (i.owner, i.attribute, i.on) not in checked]
    assert not unchecked, f"no engine built here has {unchecked} ({engines['kinds']})"


if __name__ == "__main__":  # the fixture's process
    from convbert_ds.engine.distributed import exit_process

    print(json.dumps(_check_engines()))
    exit_process(0)  # as the trainer leaves: a finalized gloo group aborts now and then
