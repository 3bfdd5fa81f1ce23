"""The rank variables a launcher sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), wrong: each is
one line before any rendezvous, said by every rank (a wrong RANK makes no rank 0), where a non-number was a
traceback from deep inside torch and a rank outside the world or a host that does not exist waited forever."""

import pytest

from convbert_ds import train
from convbert_ds.engine import distributed
from launch import TINY_CONFIG

FIX = "the launcher sets them (deepspeed, torchrun, srun, mpirun); unset them to run one process"


@pytest.mark.parametrize("launch, says", [
    ({"WORLD_SIZE": "abc"}, f"WORLD_SIZE='abc': not an integer >= 1; {FIX}"),
    ({"WORLD_SIZE": "0"}, f"WORLD_SIZE='0': not an integer >= 1; {FIX}"),
    ({"RANK": "5"}, f"RANK=5 with WORLD_SIZE=2: ranks go from 0 to 1; {FIX}"),
    ({"LOCAL_RANK": "-3"}, f"LOCAL_RANK='-3': not an integer >= 0; {FIX}"),
    ({"MASTER_PORT": "notaport"}, f"MASTER_PORT='notaport': not an integer from 1 to 65535; {FIX}"),
    ({"MASTER_PORT": "70000"}, f"MASTER_PORT='70000': not an integer from 1 to 65535; {FIX}"),
    ({"MASTER_ADDR": "no-such-host.invalid"}, "MASTER_ADDR='no-such-host.invalid': no such host ("),
], ids=["world-text", "world-zero", "rank-outside", "local-negative", "port-text", "port-range", "no-host"])
def test_a_wrong_rank_variable_is_one_line_on_every_rank(launch, says, tiny_corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(distributed, "HOST_LOOKUPS", 1)
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29511", **launch}.items():
        monkeypatch.setenv(name, value)
    code = train.main(["--config", str(TINY_CONFIG), f"data.sets=[{{path: '{tiny_corpus['shards']}'}}]",
                       f"checkpoint.dir={tmp_path / 'run'}", "train.steps=1"])
    err = [line for line in capsys.readouterr().err.splitlines() if "real_accelerator" not in line]
    assert code == 2 and len(err) == 1 and err[0].startswith(f"config error: {says}"), err
    assert not (tmp_path / "run").exists()
