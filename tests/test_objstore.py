"""``convbert_ds.objstore`` against a real S3 server (``object_store.py``) behind a network that cuts
downloads mid-body: a cut is retried within ``CONVBERT_DS_STORE_PATIENCE`` like a store that does not
answer, for every way of reading an object."""

import pytest

from convbert_ds import objstore
from object_store import CuttingProxy

DATA = bytes(range(256)) * 400  # 100 KiB: the proxy keeps 1,000 bytes of it


@pytest.fixture
def cut_store(s3, monkeypatch):
    """The session's store behind a proxy that cuts GET answers (2 unless the test says otherwise); the object
    ``s3://cuts/object``."""
    objstore.client().create_bucket(Bucket="cuts")
    objstore.put_bytes("s3://cuts/object", DATA)
    proxy = CuttingProxy(s3.port, cuts=2)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setenv(objstore.PATIENCE_VAR, "60")
    yield proxy
    proxy.close()


@pytest.mark.parametrize("read", ["read_bytes", "read_range", "sha256", "download"])
def test_a_connection_cut_mid_body_is_retried_within_the_patience(cut_store, read, tmp_path, caplog):
    url = "s3://cuts/object"
    # A download's cuts are retried by s3transfer first (5 tries), then it raises RetriesExceededError: 6 cuts
    # reach our retry.
    cut_store.cuts = 6 if read == "download" else 2
    if read == "read_bytes":
        assert objstore.read_bytes(url) == DATA
    elif read == "read_range":
        assert objstore.read_range(url, 10, 90_000) == DATA[10:90_000]
    elif read == "sha256":
        import hashlib
        assert objstore.sha256(url) == hashlib.sha256(DATA).hexdigest()
    else:
        objstore.download(url, tmp_path / "object")
        assert (tmp_path / "object").read_bytes() == DATA and [p.name for p in tmp_path.iterdir()] == ["object"]
    assert cut_store.cut == cut_store.cuts  # every cut happened, and the read went on past them
    assert "the store did not answer" in caplog.text and "retrying for up to" in caplog.text


def test_cuts_past_the_patience_end_in_one_line(s3, monkeypatch):
    objstore.client().create_bucket(Bucket="cuts")
    objstore.put_bytes("s3://cuts/object", DATA)
    proxy = CuttingProxy(s3.port, cuts=1000)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setenv(objstore.PATIENCE_VAR, "2")
    try:
        with pytest.raises(objstore.StoreError, match=r"^s3://cuts/object: the store at http://127.0.0.1:\d+ did "
                                                      r"not answer for 2 s \(\w+\); check that it is up"):
            objstore.read_bytes("s3://cuts/object")
    finally:
        proxy.close()
