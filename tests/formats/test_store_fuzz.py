"""Property-based, against a real S3 server on loopback: whatever a checkpoint mirror holds, and whatever URL a
user writes, the store's readers resume, convert or refuse in one line (a ``UserError``), within seconds:
never a traceback, a hang, or a checkpoint or shard set read as whole that is not.

A mirror holds two complete checkpoints (``upload_tag``'s layout); each example damages one object (deleted,
replaced by any bytes or any JSON, or a stray object added) in a prefix of its own. One damaged object leaves
one intact checkpoint at least, so a fresh node (the trainer's ``fetch_newer`` then ``choose_resume_tag``) must
resume from an intact one, its bytes exactly those uploaded; the converter's ``local_copy`` returns a tag whose
files match its manifest, or one line."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from convbert_ds import objstore
from convbert_ds.errors import UserError
from convbert_ds.formats.checkpoint import directory as tags, store

FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
BUCKET = "fuzz"
OLD, NEW = "step00000002", "step00000004"
JSON = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False)
                    | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                                  max_size=4), max_leaves=12)
prefixes = itertools.count()


class Objects(dict):
    """A mirror's objects by key, shown by key alone in a failing example."""

    def __repr__(self) -> str:
        return f"Objects({sorted(self)})"


def _tag_files(step: int) -> dict[str, bytes]:
    """A checkpoint's files as the trainer names them (their contents differ per step)."""
    return {"mp_rank_00_model_states.pt": bytes([step]) * 300, "trainer_state.json": json.dumps({"step": step}).encode(),
            "rng_rank00000.pt": bytes([step + 1]) * 40, "zero_pp_rank_0_mp_rank_00_optim_states.pt": bytes(700)}


@pytest.fixture(scope="module")
def mirror(s3_server, tmp_path_factory):
    """The objects of a mirror holding OLD then NEW (relative keys), uploaded as the trainer does."""
    root = tmp_path_factory.mktemp("checkpoints")
    for tag in (OLD, NEW):
        for name, data in _tag_files(tags.step_of(tag)).items():
            (root / tag / name).parent.mkdir(parents=True, exist_ok=True)
            (root / tag / name).write_bytes(data)
        tags.write_manifest(root / tag, world_size=1)
    with pytest.MonkeyPatch.context() as env:
        for name, value in s3_server.env.items():
            env.setenv(name, value)
        s3_server.client().create_bucket(Bucket=BUCKET)
        url = f"s3://{BUCKET}/original"
        for tag in (OLD, NEW):
            store.upload_tag(root, tag, url)
        return Objects({key: objstore.read_bytes(f"{url}/{key}") for key, _ in objstore.list_objects(url)})


def _damaged_copy(objects: dict[str, bytes], damage: tuple) -> str:
    """``objects`` under a new prefix, one of them damaged; the prefix's URL."""
    objects = dict(objects)
    kind, key, data = damage
    if kind == "delete":
        objects.pop(key, None)
    else:  # "replace", "add"
        objects[key] = data
    url = f"s3://{BUCKET}/case{next(prefixes)}"
    for name, body in objects.items():
        objstore.put_bytes(f"{url}/{name}", body)
    return url


def _one_line(error: UserError) -> None:
    assert "\n" not in str(error) and str(error), repr(str(error))


def _intact(objects: dict[str, bytes], directory, tag: str) -> None:
    """``directory/tag`` holds exactly what the mirror was given for ``tag`` (COMPLETE aside)."""
    held = {p.relative_to(directory / tag).as_posix(): p.read_bytes() for p in (directory / tag).rglob("*")
            if p.is_file() and p.name != tags.COMPLETE}
    assert held == {key.split("/", 1)[1]: data for key, data in objects.items()
                    if key.startswith(f"{tag}/") and not key.endswith(f"/{tags.COMPLETE}")}, tag


def damages(objects: dict[str, bytes]):
    data = st.binary(max_size=64) | JSON.map(lambda v: json.dumps(v).encode())
    keys = st.sampled_from(sorted(objects))
    stray = st.sampled_from([tags.LATEST, f"{NEW}/extra.pt", "step00000006/COMPLETE", "step00000006/a.pt",
                             "step0000000x/COMPLETE", "step00000008", f"{NEW}/COMPLETE/x"])
    return st.one_of(st.tuples(st.just("delete"), keys, st.just(b"")), st.tuples(st.just("replace"), keys, data),
                     st.tuples(st.just("add"), stray, data))


@pytest.fixture
def fuzz_env(s3, tmp_path, monkeypatch):
    monkeypatch.setenv(objstore.PATIENCE_VAR, "5")  # nothing here is transient: a retry would be a hang
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


@FUZZ
@given(data=st.data())
@example(data=None)  # the undamaged mirror
def test_a_fresh_node_resumes_from_an_intact_checkpoint_of_a_damaged_mirror(mirror, fuzz_env, data):
    damage = data.draw(damages(mirror)) if data else ("add", "unrelated", b"")
    url = _damaged_copy(mirror, damage)
    node = fuzz_env / f"node{next(prefixes)}"
    try:
        store.fetch_newer(node, url)
        tag = tags.choose_resume_tag(node, "checksum")
    except UserError as error:
        _one_line(error)
        raise AssertionError(f"{damage}: a mirror with an intact checkpoint was refused: {error}") from None
    assert tag in (OLD, NEW), (damage, tag)
    _intact(mirror, node, tag)


@FUZZ
@given(data=st.data())
def test_the_converter_gets_a_whole_checkpoint_of_a_damaged_mirror_or_one_line(mirror, fuzz_env, data):
    damage = data.draw(damages(mirror))
    url = _damaged_copy(mirror, damage)
    try:
        directory, tag = store.local_copy(url)
    except UserError as error:
        _one_line(error)
        return
    assert tags.verify(directory / tag, "checksum") is None, damage  # checked as it arrived
    _intact(mirror, directory, tag)


URL_TEXT = st.text(st.sampled_from("ab-._/~%?#:@ \t\n\\é0Z*") | st.characters(), max_size=40)


def test_a_url_of_a_scheme_alone_is_named_as_written(fuzz_env):
    from preprocessing.inspect import inspect_path

    with pytest.raises(UserError, match=r"^s3://: no bucket; write s3://BUCKET/PREFIX$"):
        inspect_path("s3://")


@FUZZ
@given(text=URL_TEXT, scheme=st.sampled_from(["s3://", "s3://fuzz/", "S3://", "gs://", "", "s3:/"]))
@example(text="", scheme="s3://")
@example(text="NOT_A_BUCKET/x", scheme="s3://")
@example(text="no-such-bucket-here/x", scheme="s3://")
def test_any_store_url_is_read_or_one_line(fuzz_env, text, scheme):
    """Every reader a URL reaches first: the checkpoint mirror's (trainer and converter) and the shards'."""
    from convbert_ds.data.remote_shards import StoreCache, mirror as mirror_shards
    from preprocessing.inspect import inspect_path

    url = scheme + text
    for read in (lambda: store.latest_complete(url), lambda: store.local_copy(url),
                 lambda: mirror_shards(url, StoreCache.at(None, 1.0)), lambda: objstore.check_writable(url),
                 lambda: inspect_path(url)):
        try:
            read()
        except UserError as error:
            _one_line(error)


@pytest.fixture(scope="module")
def shard_store(s3_server, tmp_path_factory):
    """The objects of a shard set in the store (two splits of two shards each), as ``preprocessing.shard --out
    s3://`` leaves them."""
    from shard_factory import corpus, write_shard_dir

    docs = list(corpus(20_000))
    local = write_shard_dir(tmp_path_factory.mktemp("shards") / "set", {"train": docs[:-4], "valid": docs[-4:]})
    with pytest.MonkeyPatch.context() as env:
        for name, value in s3_server.env.items():
            env.setenv(name, value)
        s3_server.client().create_bucket(Bucket=BUCKET)
        url = f"s3://{BUCKET}/shards"
        objstore.upload_tree(local, url, last=("manifest.json",))
        return Objects({key: objstore.read_bytes(f"{url}/{key}") for key, _ in objstore.list_objects(url)})


@FUZZ
@given(data=st.data())
def test_a_damaged_shard_set_in_the_store_is_verified_whole_or_one_line(shard_store, fuzz_env, data):
    """The trainer's start on a set in the store: checksums (``data.verify``), then each split opened."""
    from convbert_ds.data.shards import open_split, verify_checksums

    damage = data.draw(damages(shard_store))
    url = _damaged_copy(shard_store, damage)
    cache = fuzz_env / f"cache{next(prefixes)}"
    try:
        verify_checksums(url, cache, trust_stamp=False, record=False)
        for split in ("train", "valid"):
            open_split(url, split, cache)
    except UserError as error:
        _one_line(error)
        return
    untouched = damage[0] == "add" and damage[1] not in shard_store or shard_store.get(damage[1]) == damage[2]
    assert untouched, f"{damage}: a damaged set was read as whole"


def test_a_manifest_naming_a_file_outside_its_tag_is_refused_before_any_download(mirror, fuzz_env):
    escape = {"../../escaped.pt": {"size": 3, "sha256": "0" * 64}}
    manifest = json.dumps({"format": 1, "world_size": 1, "files": escape}).encode()
    url = _damaged_copy({**mirror, "../escaped.pt": b"bad"}, ("replace", f"{NEW}/COMPLETE", manifest))
    with pytest.raises(UserError, match=r"'\.\./\.\./escaped\.pt' is not a file name inside the tag") as refused:
        store.local_copy(url)
    _one_line(refused.value)
    assert not list(fuzz_env.rglob("escaped.pt"))


def test_a_download_whose_process_died_is_swept_by_the_next_one(mirror, fuzz_env):
    """A process stopped mid-download (killed, or by a signal before training: it exits at once) leaves its
    temporary directory; the next download on that disk deletes it, holding the lock no live download lacks."""
    url = _damaged_copy(mirror, ("add", "unrelated", b""))
    node = fuzz_env / "node"
    left = node / f".{NEW}.download-0badf00d"
    left.mkdir(parents=True)
    (left / "mp_rank_00_model_states.pt").write_bytes(bytes(100))
    assert store.fetch_newer(node, url).startswith(f"downloaded checkpoint {NEW}")
    assert sorted(p.name for p in node.iterdir()) == [".store-download.lock", tags.LATEST, NEW]
