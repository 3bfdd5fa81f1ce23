"""Slurm tests: the real job scripts under sbatch on the session's one-node cluster (the root conftest's
``cluster`` fixture, ``slurm_cluster.py``): both launchers, preemption and requeue, the up-front checks,
the sharding array job. Marked ``slow``."""
