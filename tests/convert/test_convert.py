"""DeepSpeed checkpoints of every kind the trainer writes -> transformers ConvBERT, checked by transformers.

Real 2-rank training runs (3 steps) write the checkpoints; transformers' Auto classes load the output
offline and must compute what our model computes on the checkpoint's weights. The consolidated weights
are also checked against DeepSpeed's raw files, read here without the converter.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file

from convbert_ds.convert import ConvertError, convert_checkpoint, open_checkpoint, read_state_dict, write_hf
from convbert_ds.convert.__main__ import main as cli_main
from convbert_ds.convert.model_card import CardFacts
from convbert_ds.model import ElectraForPretraining
from convbert_ds.formats.checkpoint.names import pipeline_layer_names
from launch import NOT_THE_SUBJECT, REPO, check, env, run_training
from shard_factory import read_text_documents
from slurm_cluster import recording_prefix

pytestmark = pytest.mark.slow

RUNS = {
    "zero0": ["deepspeed.config=ds_configs/zero0_fp32.json"],
    "zero1": ["deepspeed.config=ds_configs/zero1_bf16.json", "train.precision=fp32"],
    "zero2": ["deepspeed.config=ds_configs/zero2_bf16.json", "train.precision=fp32"],
    "zero3": ["deepspeed.config=ds_configs/zero3_bf16.json", "train.precision=fp32"],
    "pipeline": ["deepspeed.config=ds_configs/pipeline_zero1_bf16.json", "train.precision=fp32", "pipeline.stages=2",
                 "train.micro_batch_size=4"],
    "pipeline_bf16": ["deepspeed.config=ds_configs/pipeline_zero1_bf16.json", "train.precision=bf16",
                      "pipeline.stages=2", "train.micro_batch_size=4"],
    "mlm_zero0_bf16": ["deepspeed.config=ds_configs/zero0_bf16.json", "train.precision=bf16", "model.objective=mlm"],
    "tied": ["deepspeed.config=ds_configs/zero2_bf16.json", "train.precision=fp32", "model.tie_generator_body=true"],
    "official_generator": ["deepspeed.config=ds_configs/zero2_bf16.json", "train.precision=fp32",
                           "model.generator_heads=official"],
}
FP32_KINDS = ["zero0", "zero1", "zero2", "zero3", "pipeline", "tied"]


@pytest.fixture(scope="module")
def runs(tiny_corpus, tmp_path_factory):
    """One 3-step training run per checkpoint kind; {kind: checkpoint.dir}."""
    root = tmp_path_factory.mktemp("convert_runs")
    out = {}
    for kind, overrides in RUNS.items():
        check(run_training(root / kind, tiny_corpus["shards"], *overrides, "train.steps=3", "eval.interval=0",
                           launcher=NOT_THE_SUBJECT))
        out[kind] = root / kind / "checkpoints"
    return out


@pytest.fixture(scope="module")
def converted(runs, tmp_path_factory):
    root = tmp_path_factory.mktemp("converted")
    report = {kind: convert_checkpoint(runs[kind], root / kind, verify=True) for kind in runs}
    return {kind: root / kind for kind in runs}, report


def _text_batch(tiny_corpus, n=4, length=40):
    """[CLS] A [SEP] B [SEP] pairs of real corpus lines, padded: encoded by preprocessing's tokenizer."""
    from preprocessing.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_corpus["tokenizer"])
    lines = [line for doc in read_text_documents(tiny_corpus["corpus"])[:40] for line in doc]
    cls, sep, pad = (tok.special_ids[k] for k in ("cls", "sep", "pad"))
    ids = torch.full((n, length), pad)
    types, mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for row in range(n):
        a, b = tok.encode(lines[2 * row])[:12 + 3 * row], tok.encode(lines[2 * row + 1])[:10]
        seq = [cls, *a, sep, *b, sep]
        ids[row, :len(seq)] = torch.tensor(seq)
        mask[row, :len(seq)] = 1
        types[row, len(a) + 2:len(seq)] = 1
    return ids, mask, types


def _our_model(checkpoint_dir) -> ElectraForPretraining:
    ckpt = open_checkpoint(checkpoint_dir)
    weights, _ = read_state_dict(ckpt)
    model = ElectraForPretraining(ckpt.electra)
    model.load_state_dict(weights)
    return model.eval()


def _hf(cls, directory):
    model, info = cls.from_pretrained(str(directory), local_files_only=True, output_loading_info=True,
                                      dtype=torch.float32)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


@pytest.mark.parametrize("kind", FP32_KINDS)
def test_checkpoint_converts_to_transformers_with_equal_outputs(kind, runs, converted, tiny_corpus):
    out = converted[0][kind]
    for name, arch in (("discriminator", "ConvBertModel"), ("generator", "ConvBertForMaskedLM")):
        config = json.loads((out / name / "config.json").read_text())
        assert config["model_type"] == "convbert" and config["architectures"] == [arch]
        assert config["pad_token_id"] == 0 and config["vocab_size"] == 2000
    assert max(converted[1][kind].values()) < 1e-5, converted[1][kind]

    ours = _our_model(runs[kind])
    ids, mask, types = _text_batch(tiny_corpus)
    body = _hf(transformers.AutoModel, out / "discriminator")
    mlm = _hf(transformers.AutoModelForMaskedLM, out / "generator")
    assert type(body).__name__ == "ConvBertModel" and type(mlm).__name__ == "ConvBertForMaskedLM"
    with torch.no_grad():
        hidden = body(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        torch.testing.assert_close(hidden, ours.discriminator.convbert(ids, mask, types), atol=1e-5, rtol=0)
        logits = mlm(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
        torch.testing.assert_close(logits, ours.generator(ids, mask, types), atol=1e-5, rtol=0)
        # The RTD head side file, applied the way ELECTRA's head is, gives our discriminator's logits.
        head = load_file(str(out / "discriminator" / "rtd_head.safetensors"))
        p = "discriminator_predictions."
        act = transformers.activations.ACT2FN[body.config.hidden_act]
        rtd = torch.nn.functional.linear(act(torch.nn.functional.linear(hidden, head[p + "dense.weight"],
                                                                        head[p + "dense.bias"])),
                                         head[p + "dense_prediction.weight"], head[p + "dense_prediction.bias"])
        torch.testing.assert_close(rtd.squeeze(-1), ours.discriminator(ids, mask, types), atol=1e-5, rtol=0)
    # Each model directory records its files' sha256 in sha256sum's own format, the model card aside.
    for name in ("discriminator", "generator"):
        listed = subprocess.run(["sha256sum", "-c", "checksums.sha256"], cwd=out / name, capture_output=True,
                                text=True, check=True).stdout
        assert {line.split(":")[0] for line in listed.splitlines()} == {
            p.name for p in (out / name).iterdir() if p.name not in ("README.md", "checksums.sha256")}
    # The explicit LM head is the (shared) word-embedding table.
    gen = load_file(str(out / "generator" / "model.safetensors"))
    assert torch.equal(gen["generator_lm_head.weight"], gen["convbert.embeddings.word_embeddings.weight"])
    card = (out / "README.md").read_text()
    assert "steps: 3" in card and "tokens seen: 3,072" in card and tiny_corpus_sha(tiny_corpus) in card
    # The Hub's front matter: what it reads to list and tag the model. No --license: none (the card asks for
    # one); a local corpus is no Hub dataset id, so no datasets (tests/convert/test_model_card.py has both).
    meta = yaml.safe_load(card.split("---")[1])
    assert meta == {"library_name": "transformers", "tags": ["convbert", "electra", "convbert_ds", "pretraining"],
                    "pipeline_tag": "feature-extraction"}
    assert yaml.safe_load((out / "generator" / "README.md").read_text().split("---")[1])["pipeline_tag"] == "fill-mask"
    assert "global batch 16" in card and "- no validation pass before this checkpoint" in card
    assert "hf upload ORG/NAME discriminator ." in card


def test_exported_models_take_512_tokens_whatever_the_training_length(runs, converted):
    """The runs trained at seq_len 64; their position tables (512 by default, as the official config) are
    whole in the export, and transformers computes what our model computes over 512 tokens."""
    out, ours = converted[0]["zero2"], _our_model(runs["zero2"])
    assert json.loads((out / "discriminator" / "config.json").read_text())["max_position_embeddings"] == 512
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 2000, (2, 512), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 300:] = 0
    ids[1, 300:] = 0
    types = torch.zeros_like(ids)
    types[:, 200:] = 1
    body = _hf(transformers.AutoModel, out / "discriminator")
    mlm = _hf(transformers.AutoModelForMaskedLM, out / "generator")
    with torch.no_grad():
        hidden = body(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        assert hidden.shape == (2, 512, 128)
        torch.testing.assert_close(hidden, ours.discriminator.convbert(ids, mask, types), atol=1e-5, rtol=0)
        torch.testing.assert_close(mlm(input_ids=ids, attention_mask=mask, token_type_ids=types).logits,
                                   ours.generator(ids, mask, types), atol=1e-5, rtol=0)


def test_official_generator_heads_export_the_discriminator_and_say_why_not_the_generator(runs, converted):
    """The official code's small-generator layout (1 attention + 1 conv head of the full head size, wider than
    hidden) has no transformers equivalent: the discriminator is written and verified, the generator is not,
    and the model card says why."""
    out, ours = converted[0]["official_generator"], _our_model(runs["official_generator"])
    generator = ours.config.generator
    assert (generator.hidden_size, generator.num_heads, generator.head_dim) == (32, 1, 32)
    assert ours.generator.convbert.encoder.layer[0].attention.output.dense.in_features == 64
    assert not (out / "generator").exists() and (out / "discriminator" / "model.safetensors").is_file()
    assert "generator/ is not written" in (out / "README.md").read_text()
    assert "attention_head_size=32" in (out / "README.md").read_text()
    assert max(converted[1]["official_generator"].values()) < 1e-5
    body = _hf(transformers.AutoModel, out / "discriminator")
    ids = torch.randint(5, 2000, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(body(input_ids=ids).last_hidden_state, ours.discriminator.convbert(ids),
                                   atol=1e-5, rtol=0)


def test_tied_generator_exports_the_discriminator_encoder(converted):
    """tie_generator_body: ZeRO keeps one copy of the shared encoder; both exports carry it."""
    disc = load_file(str(converted[0]["tied"] / "discriminator" / "model.safetensors"))
    gen = load_file(str(converted[0]["tied"] / "generator" / "model.safetensors"))
    assert disc and all(torch.equal(gen[f"convbert.{name}"], tensor) for name, tensor in disc.items())


def tiny_corpus_sha(tiny_corpus) -> str:
    return json.loads((tiny_corpus["shards"] / "manifest.json").read_text())["tokenizer"]["sha256"]


def test_consolidated_weights_equal_deepspeeds_raw_files(runs, converted):
    """ZeRO 1-3 consolidate to what the same run wrote unsharded (ZeRO 0); pipeline = its layer files."""
    raw = torch.load(runs["zero0"] / "step00000003" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    for kind in ("zero0", "zero1", "zero2", "zero3"):
        disc = load_file(str(converted[0][kind] / "discriminator" / "model.safetensors"))
        for name, tensor in disc.items():
            torch.testing.assert_close(tensor, raw[f"discriminator.convbert.{name}"], atol=1e-6, rtol=0)
    ckpt = open_checkpoint(runs["pipeline"])
    disc = load_file(str(converted[0]["pipeline"] / "discriminator" / "model.safetensors"))
    head = load_file(str(converted[0]["pipeline"] / "discriminator" / "rtd_head.safetensors"))
    gen = load_file(str(converted[0]["pipeline"] / "generator" / "model.safetensors"))
    flat = {**{f"discriminator.convbert.{k}": v for k, v in disc.items()},
            **{f"discriminator.{k}": v for k, v in head.items()}, **{f"generator.{k}": v for k, v in gen.items()}}
    seen = 0
    for index, prefix in pipeline_layer_names(ckpt.electra).items():
        for key, tensor in torch.load(ckpt.directory / f"layer_{index:02d}-model_states.pt").items():
            assert torch.equal(flat[prefix + key], tensor), prefix + key
            seen += 1
    assert seen == len(set(flat)) - 6  # all but the generator's 5 shared embedding names and its tied LM head


@pytest.mark.parametrize("kind", ["pipeline_bf16", "mlm_zero0_bf16"])
def test_bf16_checkpoints_give_the_fp32_master_weights(kind, runs, converted):
    out = converted[0][kind]
    gen = load_file(str(out / "generator" / "model.safetensors"))
    ckpt = open_checkpoint(runs[kind])
    if ckpt.stages > 1:
        names = pipeline_layer_names(ckpt.electra)
        layer = torch.load(ckpt.directory / "layer_05-model_states.pt")
        assert names[5] == "generator."
        module = {k: v for k, v in layer.items()}
    else:
        states = torch.load(ckpt.directory / "mp_rank_00_model_states.pt", weights_only=False)["module"]
        module = {k.removeprefix("generator."): v for k, v in states.items() if k.startswith("generator.")}
    assert all(v.dtype == torch.bfloat16 for v in module.values())
    differs = 0
    for key, low in module.items():
        assert gen[key].dtype == torch.float32 and torch.equal(gen[key].to(torch.bfloat16), low), key
        differs += not torch.equal(gen[key], low.float())
    assert differs > 0  # real fp32 masters, not the bf16 weights upcast
    assert max(converted[1][kind].values()) < 1e-5


def test_mlm_checkpoint_gives_the_main_size_masked_lm_only(runs, converted, tiny_corpus):
    out = converted[0]["mlm_zero0_bf16"]
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "generator"]
    config = json.loads((out / "generator" / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (128, 2)  # the tiny preset's main model
    ours = _our_model(runs["mlm_zero0_bf16"])
    ids, mask, types = _text_batch(tiny_corpus)
    with torch.no_grad():
        logits = _hf(transformers.AutoModelForMaskedLM, out / "generator")(
            input_ids=ids, attention_mask=mask, token_type_ids=types).logits
    torch.testing.assert_close(logits, ours.generator(ids, mask, types), atol=1e-5, rtol=0)


def test_converted_tokenizer_gives_the_training_shards_ids(converted, tiny_corpus):
    from shard_factory import read_split_documents

    shard_ids = {tuple(seq) for split in ("train", "valid")
                 for doc in read_split_documents(tiny_corpus["shards"], split) for seq in doc}
    lines = [line for doc in read_text_documents(tiny_corpus["corpus"])[:200] for line in doc]
    for directory in (converted[0]["zero2"] / "discriminator", converted[0]["zero2"] / "generator"):
        tok = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        encoded = [tuple(tok(line, add_special_tokens=False)["input_ids"]) for line in lines]
        assert all(ids in shard_ids for ids in encoded)
        assert tok.pad_token_id == 0 and tok.mask_token_id == 4


def test_bf16_output_dtype_loads_and_verifies(runs, tmp_path):
    report = convert_checkpoint(runs["zero2"], tmp_path / "out", dtype="bf16", verify=True)
    assert max(report.values()) < 1e-4
    weights = load_file(str(tmp_path / "out" / "discriminator" / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "out" / "discriminator" / "config.json").read_text())["dtype"] == "bfloat16"


def _cli(capsys, *args) -> tuple[int, str]:
    code = cli_main([str(a) for a in args])
    err = capsys.readouterr().err
    return code, err


def _copy(runs, kind, tmp_path):
    target = tmp_path / kind
    shutil.copytree(runs[kind], target)
    return target, target / "step00000003"


def test_missing_shards_and_layer_files_are_listed(runs, tmp_path, capsys):
    ckpt, tag = _copy(runs, "zero3", tmp_path)
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    (tag / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    code, err = _cli(capsys, "--checkpoint", ckpt, "--out", tmp_path / "out")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in err and "zero_pp_rank_1_mp_rank_00_model_states.pt" in err
    ckpt, tag = _copy(runs, "pipeline", tmp_path)
    (tag / "layer_08-model_states.pt").unlink()
    code, err = _cli(capsys, "--checkpoint", ckpt, "--out", tmp_path / "out")
    assert code == 2 and "layer_08-model_states.pt" in err and "missing 1 file" in err
    assert not (tmp_path / "out").exists()


def test_config_that_does_not_fit_the_weights_names_tensor_and_shapes(runs, tmp_path, capsys):
    ckpt, tag = _copy(runs, "zero1", tmp_path)
    state = json.loads((tag / "trainer_state.json").read_text())
    state["electra_config"]["discriminator"]["intermediate_size"] = 384
    (tag / "trainer_state.json").write_text(json.dumps(state))
    code, err = _cli(capsys, "--checkpoint", ckpt, "--out", tmp_path / "out")
    assert code == 2, err
    assert "discriminator.convbert.encoder.layer.0.intermediate.dense.weight" in err
    assert "(256, 128)" in err and "(384, 128)" in err


def test_output_is_refused_unless_forced_and_replaced_whole(runs, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    code, err = _cli(capsys, "--checkpoint", runs["zero0"], "--out", out)
    assert code == 2 and "--force" in err and (out / "keep.txt").is_file()
    code, err = _cli(capsys, "--checkpoint", runs["zero0"], "--tag", "step00000003", "--out", out, "--force")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "discriminator", "generator"]
    assert "--force" in (out / "README.md").read_text()  # the conversion command is recorded


def test_a_failure_mid_write_leaves_no_model(runs, tmp_path):
    """A tokenizer that cannot load makes the conversion fail after the weights are written: no OUT, no
    temporary directory, and a previous OUT stays as it was."""
    ckpt = open_checkpoint(runs["zero0"])
    weights, _ = read_state_dict(ckpt)
    broken = tmp_path / "tokenizer"
    shutil.copytree(ckpt.state.tokenizer["dir"], broken)
    (broken / "tokenizer.json").write_text("{not json")
    (broken / "tokenizer.model").unlink()
    facts = CardFacts(source="test", command="test")
    with pytest.raises(Exception):
        write_hf(tmp_path / "out", weights, ckpt.electra, broken, facts, verify=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer"]
    write_hf(tmp_path / "out", weights, ckpt.electra, ckpt.state.tokenizer["dir"], facts)
    before = (tmp_path / "out" / "discriminator" / "model.safetensors").read_bytes()
    with pytest.raises(Exception):
        write_hf(tmp_path / "out", weights, ckpt.electra, broken, facts, verify=True, force=True)
    assert (tmp_path / "out" / "discriminator" / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tokenizer"]


def test_tokenizer_gone_or_changed_is_an_error_and_tokenizer_flag_fixes_it(runs, tmp_path, tiny_corpus, capsys):
    ckpt, tag = _copy(runs, "zero2", tmp_path)
    state = json.loads((tag / "trainer_state.json").read_text())
    state["tokenizer"]["dir"] = str(tmp_path / "moved-away")
    (tag / "trainer_state.json").write_text(json.dumps(state))
    code, err = _cli(capsys, "--checkpoint", ckpt, "--out", tmp_path / "out")
    assert code == 2 and "moved-away" in err and "--tokenizer" in err
    changed = tmp_path / "changed"
    shutil.copytree(tiny_corpus["tokenizer"], changed)
    (changed / "tokenizer_config.json").write_text("{}")
    code, err = _cli(capsys, "--checkpoint", ckpt, "--out", tmp_path / "out", "--tokenizer", changed)
    assert code == 2 and "sha256" in err and state["tokenizer"]["sha256"] in err
    code, err = _cli(capsys, "--checkpoint", ckpt, "--out", tmp_path / "out", "--tokenizer", tiny_corpus["tokenizer"])
    assert code == 0, err


def test_incomplete_or_absent_checkpoints_are_errors(runs, tmp_path, capsys):
    ckpt, tag = _copy(runs, "zero0", tmp_path)
    (tag / "COMPLETE").unlink()
    code, err = _cli(capsys, "--checkpoint", ckpt, "--out", tmp_path / "out")
    assert code == 2 and "no complete checkpoint" in err
    code, err = _cli(capsys, "--checkpoint", ckpt, "--tag", "step00000003", "--out", tmp_path / "out")
    assert code == 2 and "incomplete" in err
    code, err = _cli(capsys, "--checkpoint", tmp_path / "nowhere", "--out", tmp_path / "out")
    assert code == 2 and "does not exist" in err
    with pytest.raises(ConvertError, match="step00000009 not found"):
        open_checkpoint(runs["zero0"], "step00000009")


def test_cli_in_a_fresh_process_prints_one_line_errors(runs, tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "convbert_ds.convert", *map(str, args)], cwd=REPO, env=env(),
                              capture_output=True, text=True, timeout=300)

    done = cli("--checkpoint", runs["zero3"], "--out", tmp_path / "out", "--verify")
    assert done.returncode == 0, done.stderr
    assert "verified: max abs difference" in done.stdout and done.stderr == ""
    for args, needle in ((["--out", tmp_path / "x"], "--checkpoint"),
                         (["--checkpoint", runs["zero3"], "--out", tmp_path / "out"], "not empty")):
        bad = cli(*args)
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        assert needle in bad.stderr and "Traceback" not in bad.stderr


def test_slurm_script_by_hand_and_its_env_variable(runs, tmp_path):
    activate = tmp_path / "activate"
    activate.write_text(f"export PATH={REPO / '.venv' / 'bin'}:$PATH\n")
    script = REPO / "slurm" / "convert.sbatch"
    done = subprocess.run(["bash", str(script), "--checkpoint", str(runs["zero1"]), "--out", "out"], cwd=tmp_path,
                          env={**env(), "CONVBERT_DS_ENV": str(activate)}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "out" / "discriminator" / "model.safetensors").is_file()  # relative to the cwd
    missing = subprocess.run(["bash", str(script), "--checkpoint", "x", "--out", "y"], cwd=tmp_path,
                             env={**env(), "CONVBERT_DS_ENV": str(tmp_path / "none.sh")}, capture_output=True,
                             text=True)
    assert missing.returncode == 2 and "CONVBERT_DS_ENV" in missing.stderr


def test_slurm_job_converts_on_a_real_cluster(runs, cluster, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("submit")
    prefix, record = recording_prefix(workdir)  # as a container launcher would be
    job_env = {**cluster.env(env()), "CONVBERT_DS_ENV": str(Path(sys.executable).parent / "activate"),
               "CONVBERT_DS_LAUNCH_PREFIX": prefix}
    jobs = {}
    for name, args in (("good", ["--checkpoint", str(runs["zero3"]), "--out", "hf", "--verify"]),
                       ("bad", ["--checkpoint", "nowhere", "--out", "hf2"])):
        out = cluster.run("sbatch", "--parsable", "--cpus-per-task=1", "--time=10",
                          str(REPO / "slurm" / "convert.sbatch"), *args, cwd=workdir, env=job_env).stdout
        jobs[name] = out.strip().split(";")[0]
    good, bad = (cluster.wait_job(jobs[name], 300) for name in ("good", "bad"))
    log = "".join(p.read_text() for p in workdir.glob("*.out"))
    assert (good["JobState"], good["ExitCode"]) == ("COMPLETED", "0:0"), log[-4000:]
    assert (workdir / "hf" / "discriminator" / "model.safetensors").is_file()
    assert "verified: max abs difference" in log
    assert (bad["JobState"], bad["ExitCode"]) == ("FAILED", "2:0") and "convert error:" in log
    assert [call.split()[:4] for call in record.read_text().splitlines()] == \
        [["image.sif", "python", "-m", "convbert_ds.convert"]] * 2
