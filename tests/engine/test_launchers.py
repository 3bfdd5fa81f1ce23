"""How the trainer finds its rank and rendezvous under Slurm (``convbert_ds/engine/distributed.py``), without
starting anything."""

from convbert_ds.engine import distributed


def test_the_slurm_rendezvous_port_differs_per_job_and_stays_below_the_ephemeral_ports(monkeypatch):
    # Jobs sharing a node take different ports; none takes one in Linux's default ephemeral range (32768
    # and up), where any open connection may hold it: at job id 16237 the port was 36237, and the suite's
    # Slurm job found it taken.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    ports = []
    for job in range(16230, 16250):
        monkeypatch.setenv("SLURM_JOB_ID", str(job))
        ports.append(int(distributed._from_slurm()["MASTER_PORT"]))
    assert len(set(ports)) == len(ports) and all(20000 <= port < 32768 for port in ports), ports


def test_a_collective_that_lost_its_peer_is_one_line_and_other_errors_are_not(monkeypatch):
    """What gloo raises on the ranks that are left when a peer's process or node dies (the text of torch 2.13's
    gloo); the line names the peer's address. Anything else keeps its traceback (None)."""
    monkeypatch.setenv("RANK", "3")
    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                        "[10.0.0.7]:7553: Connection reset by peer. This is typically caused by a remote worker")
    said = distributed.lost_peer(gloo)
    assert said.startswith("error: rank 3 lost its connection to another rank (10.0.0.7:7553, connection reset by "
                           "peer)") and f"exiting with code {distributed.EXIT_PEER_LOST}" in said
    assert "\n" not in said
    assert distributed.lost_peer(RuntimeError("CUDA out of memory")) is None
    assert distributed.lost_peer(ValueError("Connection reset by peer")) is None  # not a collective's error
