"""The Slurm tests' cluster: real ``slurmctld`` + ``slurmd`` on loopback (``slurm_cluster.py``), started once."""

import pytest

from slurm_cluster import SlurmCluster, SlurmUnavailable


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """A real one-node Slurm cluster on loopback (tests/slurm/slurm_cluster.py), started once for the session."""
    try:
        with SlurmCluster(tmp_path_factory.mktemp("slurm")) as slurm:  # stops the daemons however we leave
            yield slurm
    except SlurmUnavailable as error:  # only start() raises it: no slurm-wlm and no way to install it
        pytest.skip(str(error))
