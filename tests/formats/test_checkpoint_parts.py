"""Checkpoints on node-local disks (a real S3 server on loopback): each node uploads its part, the tag is complete
in the store only once COMPLETE, the union of every part, is there; and how the trainer tells node-local disks
from a shared one (``checkpoint_disk._partition``). Training across two emulated nodes with these:
``tests/slurm/test_several_nodes.py``."""

import json

import pytest

from convbert_ds import objstore
from convbert_ds.engine.checkpoint_disk import _partition
from convbert_ds.formats.checkpoint import directory as tags, store

TAG = "step00000004"


def node_part(root, node: str, files: dict[str, bytes]):
    """What one node's disk holds of TAG: ``files`` under ``root/node/TAG``; returns ``root/node``."""
    for name, data in files.items():
        (root / node / TAG / name).parent.mkdir(parents=True, exist_ok=True)
        (root / node / TAG / name).write_bytes(data)
    return root / node


@pytest.fixture
def two_parts(s3, tmp_path):
    """Two nodes' parts of TAG, and a store prefix of this test's own in a bucket no other test file uses (the
    server lives for the session)."""
    s3.client().create_bucket(Bucket="parts")
    n1 = node_part(tmp_path, "n1", {"mp_rank_00_model_states.pt": b"weights", "trainer_state.json": b"{}",
                                    "rng_rank00000.pt": b"r0"})
    n2 = node_part(tmp_path, "n2", {"zero_pp_rank_1_mp_rank_00_optim_states.pt": b"adam", "rng_rank00001.pt": b"r1"})
    return n1, n2, f"s3://parts/{tmp_path.name}"


def test_the_tag_is_complete_once_every_part_is_in_and_downloads_whole(two_parts, tmp_path):
    n1, n2, url = two_parts
    first, sent, _ = store.upload_part(n1, TAG, url)
    assert sent == len(b"weights{}r0") and store.complete_tags(url) == []  # one part: not complete yet
    second, _, _ = store.upload_part(n2, TAG, url)
    store.commit_parts(url, TAG, [first, second], world_size=2)
    assert store.complete_tags(url) == [TAG] and store.latest_complete(url) == TAG
    manifest = json.loads(objstore.read_bytes(f"{url}/{TAG}/COMPLETE"))
    assert manifest["world_size"] == 2 and set(manifest["files"]) == set(first) | set(second)
    store.download_tag(url, TAG, tmp_path / "fresh")  # a new machine: the whole tag, verified by checksum
    assert tags.verify(tmp_path / "fresh" / TAG, "checksum") is None
    assert (tmp_path / "fresh" / TAG / "rng_rank00001.pt").read_bytes() == b"r1"


def test_a_part_missing_from_the_store_leaves_the_tag_incomplete_and_latest_where_it_was(two_parts):
    n1, n2, url = two_parts
    first, _, _ = store.upload_part(n1, TAG, url)
    objstore.put_bytes(f"{url}/latest", b"step00000002\n")
    second = tags.build_manifest(n2 / TAG, 0)["files"]  # n2 listed its files, but its upload never happened
    with pytest.raises(objstore.StoreError, match="rng_rank00001.pt: not in the store"):
        store.commit_parts(url, TAG, [first, second], world_size=2)
    assert store.complete_tags(url) == []
    assert objstore.read_bytes(f"{url}/latest") == b"step00000002\n"


def test_two_nodes_that_wrote_different_files_under_one_name_are_refused(two_parts):
    n1, n2, url = two_parts
    first, _, _ = store.upload_part(n1, TAG, url)
    clash = {**tags.build_manifest(n2 / TAG, 0)["files"], "rng_rank00000.pt": {"size": 2, "sha256": "0" * 64}}
    with pytest.raises(objstore.StoreError, match="two nodes wrote different files"):
        store.commit_parts(url, TAG, [first, clash], world_size=2)
    assert store.complete_tags(url) == []


@pytest.mark.parametrize("views,blocks", [
    ([[0, 1, 2, 3]] * 4, [[0, 1, 2, 3]]),  # shared (probe decides that before asking)
    ([[0, 1], [0, 1], [2, 3], [2, 3]], [[0, 1], [2, 3]]),  # two nodes, two disks
    ([[0], [1]], [[0], [1]]),  # one rank per node
    ([[0, 1], [1], [2, 3], [2, 3]], None),  # rank 1 does not see rank 0's file, rank 0 sees its: not yet settled
    ([[1], [1]], None),  # rank 0 does not see its own file
])
def test_node_local_disks_are_ranks_that_see_exactly_each_others_files(views, blocks):
    assert _partition(views) == blocks
