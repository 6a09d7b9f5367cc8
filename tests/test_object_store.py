"""A bucket as the mirror, against a real S3 server (SeaweedFS, started here), its faults
through the tests' proxy (loaderplug.testing.object_proxy): hydrate, sync, loads and
one passes of s3:// URLs; ranges retried, objects replaced mid-read named as changed,
clear errors that name the URL and never a secret."""

from __future__ import annotations

import errno
import filecmp
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import loaderplug
from loaderplug.errors import MirrorError, SettingsError, TransferFailed
from loaderplug.jobs.partial import JOURNAL_SUFFIX
from loaderplug.storage.object_store import ObjectInfo, ObjectStore, store_for
from loaderplug.storage.object_urls import ObjectURL
from loaderplug.testing.model import write_model
from loaderplug.testing.object_proxy import Fault, ObjectProxy
from loaderplug.testing.object_server import KEYS, SeaweedS3
from tests.conftest import tree_bytes
from tests.s3server import BUCKET, OBJECT_FAST, fresh_prefix, key_of, upload
from tests.s3server import proxy as proxy
from tests.s3server import s3 as s3
from tests.s3server import server as server


@pytest.fixture
def uploaded(s3: SeaweedS3, tmp_path: Path) -> tuple[Path, str]:
    """A 4 MiB model of 3 shards, on local disk and in the bucket."""
    folder = tmp_path / "model"
    write_model(folder, 4 << 20, 3)
    return folder, upload(s3, folder, fresh_prefix())


def same_tree(a: Path, b: Path) -> bool:
    return tree_bytes(a) == tree_bytes(b)


def test_a_hydrate_from_a_bucket_copies_every_object_and_a_rerun_skips_them(
    uploaded: tuple[Path, str], tmp_path: Path
) -> None:
    folder, url = uploaded
    report = loaderplug.hydrate(url, tmp_path / "local", **OBJECT_FAST)
    assert same_tree(folder, tmp_path / "local")
    assert len(report.restored) == 5
    again = loaderplug.hydrate(url, tmp_path / "local", **OBJECT_FAST)
    assert len(again.skipped) == 5 and not again.restored


def test_a_sync_to_a_bucket_writes_the_manifest_last_and_a_hydrate_reads_it_back(
    s3: SeaweedS3, model: Path, tmp_path: Path
) -> None:
    url = f"s3://{BUCKET}/{fresh_prefix()}"
    report = loaderplug.sync(model, url, **OBJECT_FAST)
    assert report.ok and len(report.restored) == 6
    keys = [
        o["Key"] for o in s3.client().list_objects_v2(Bucket=BUCKET, Prefix=key_of(url))["Contents"]
    ]
    assert any(k.endswith(".loaderplug-manifest.json") for k in keys)
    assert not any(k.endswith(".loaderplug-sync") for k in keys)  # the mark is gone
    loaderplug.hydrate(url, tmp_path / "back", **OBJECT_FAST)
    assert same_tree(model, tmp_path / "back")


def test_a_hydrate_copies_only_what_the_manifest_names_at_its_versions(
    s3: SeaweedS3, model: Path, tmp_path: Path
) -> None:
    url = f"s3://{BUCKET}/{fresh_prefix()}"
    loaderplug.sync(model, url, **OBJECT_FAST)
    prefix = key_of(url)
    client = s3.client()
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/later.bin", Body=b"a later sync's")
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/config.json", Body=b"{}")  # rewritten
    report = loaderplug.hydrate(url, tmp_path / "local", check=False, **OBJECT_FAST)
    assert not (tmp_path / "local" / "later.bin").exists()
    assert not (tmp_path / "local" / "config.json").exists()
    (failed,) = report.failed
    assert failed.path == "config.json" and "changed since the mirror's manifest" in failed.reason


def test_a_sync_refuses_while_another_holds_the_mark_and_takes_over_a_stale_one(
    s3: SeaweedS3, model: Path
) -> None:
    url = f"s3://{BUCKET}/{fresh_prefix()}"
    mark = key_of(url) + "/.loaderplug-sync"
    s3.client().put_object(Bucket=BUCKET, Key=mark, Body=b'{"token": "another"}')
    with pytest.raises(MirrorError, match="another sync is writing"):
        loaderplug.sync(model, url, **OBJECT_FAST, sync_stale_s=2)
    time.sleep(2.5)  # the mark is now older than sync_stale_s: a dead sync's
    report = loaderplug.sync(model, url, **OBJECT_FAST, sync_stale_s=2)
    assert report.ok


def test_tensors_of_objects_equal_safetensors_and_a_one_pass_publishes_the_copy(
    uploaded: tuple[Path, str], tmp_path: Path
) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    folder, url = uploaded
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    urls = [f"{url}/{name}" for name in shards]
    for local in (None, tmp_path / "local"):
        load = loaderplug.iter_tensors(urls, local_dir=local, **OBJECT_FAST)
        got = dict(load)
        want = {k: v for n in shards for k, v in load_file(folder / n).items()}
        assert got.keys() == want.keys()
        for name, tensor in want.items():
            assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name
        assert all("ranged GETs" in mode for mode in load.io_modes.values())
    for name in shards:
        assert filecmp.cmp(folder / name, tmp_path / "local" / name, shallow=False)
    assert loaderplug.load_file(urls[0]).keys() == load_file(folder / shards[0]).keys()


@pytest.mark.parametrize("kind", ["slowdown", "throttle", "reset", "hang"])
def test_a_range_the_store_fails_once_is_retried_alone(
    uploaded: tuple[Path, str], proxy: ObjectProxy, tmp_path: Path, kind: str
) -> None:
    folder, url = uploaded
    fault = proxy.add(Fault(kind, key="model-00002", hang_s=30))
    report = loaderplug.hydrate(url, tmp_path / "local", **OBJECT_FAST)
    assert fault.hits == 1
    assert report.retries >= 1
    assert same_tree(folder, tmp_path / "local")
    # Only the failed range was asked again, never the whole object.
    ranged = [p for m, p, r in proxy.requests if m == "GET" and "model-00002" in p and r]
    spans = -(-(folder / "model-00002-of-00003.safetensors").stat().st_size // (1 << 20))
    assert len(ranged) == spans + 1


def test_an_object_replaced_mid_read_fails_as_changed_and_publishes_nothing(
    s3: SeaweedS3, uploaded: tuple[Path, str], proxy: ObjectProxy, tmp_path: Path
) -> None:
    folder, url = uploaded
    key = key_of(url) + "/model-00001-of-00003.safetensors"
    other = os.urandom((folder / "model-00001-of-00003.safetensors").stat().st_size)

    def replace() -> None:
        s3.client().put_object(Bucket=BUCKET, Key=key, Body=other)

    # The third range asked replaces the object before the store answers it.
    proxy.add(Fault("callback", key="model-00001", times=1, callback=replace))
    with pytest.raises(TransferFailed) as failed:
        loaderplug.hydrate(url, tmp_path / "local", **{**OBJECT_FAST, "readers": 1})
    (result,) = failed.value.report.failed
    assert "replaced while being read" in result.reason or "changed" in result.reason
    assert not (tmp_path / "local" / "model-00001-of-00003.safetensors").exists()
    again = loaderplug.hydrate(url, tmp_path / "local", **OBJECT_FAST)
    assert again.ok
    assert (tmp_path / "local" / "model-00001-of-00003.safetensors").read_bytes() == other


def test_wrong_credentials_fail_naming_the_url_and_never_the_secret(
    uploaded: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, url = uploaded
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-42")
    with pytest.raises(OSError) as raised:
        loaderplug.hydrate(url, tmp_path / "local", **OBJECT_FAST)
    text = str(raised.value)
    assert raised.value.errno == errno.EACCES and url in text
    assert "not-the-secret-42" not in text and KEYS["writer"][1] not in text
    assert not (tmp_path / "local").exists() or tree_bytes(tmp_path / "local") == {}


def test_a_bucket_this_identity_may_not_read_is_a_clear_403(
    uploaded: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, url = uploaded
    key, secret = KEYS["stranger"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    with pytest.raises(PermissionError, match="access denied") as raised:
        loaderplug.hydrate(url, tmp_path / "local", **OBJECT_FAST)
    assert secret not in str(raised.value)


def test_a_missing_bucket_and_a_missing_key_are_named(s3: SeaweedS3, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="s3://no-such-bucket/x"):
        loaderplug.hydrate("s3://no-such-bucket/x", tmp_path / "a", **OBJECT_FAST)
    with pytest.raises(FileNotFoundError, match="no objects under"):
        loaderplug.hydrate(f"s3://{BUCKET}/no/such/prefix", tmp_path / "b", **OBJECT_FAST)
    with pytest.raises(FileNotFoundError, match="no such object"):
        dict(loaderplug.iter_tensors([f"s3://{BUCKET}/no/such.safetensors"], **OBJECT_FAST))


def test_a_store_that_hangs_fails_within_the_timeout_and_retries(
    uploaded: tuple[Path, str], proxy: ObjectProxy, tmp_path: Path
) -> None:
    _, url = uploaded
    proxy.add(Fault("hang", key="model-00003", times=100, hang_s=60))
    with pytest.raises(TransferFailed) as failed:
        loaderplug.hydrate(url, tmp_path / "local", **{**OBJECT_FAST, "retry_attempts": 2})
    reasons = [r.reason for r in failed.value.report.failed]
    assert reasons and all("model-00003" in r.path for r in failed.value.report.failed)
    assert any("failed after 2 attempts" in r for r in reasons), reasons


@pytest.mark.parametrize(
    "url",
    [
        "hdfs://models/x",
        "s3://ab",
        "s3://user:secret@models/x",
        "s3://AKIA:wJal/secret+key@models/x",  # a secret key holding "/"
        "s3://models/x/../y",
    ],
)
def test_a_url_that_is_not_a_bucket_and_prefix_is_refused_clearly(url: str, tmp_path: Path) -> None:
    with pytest.raises(SettingsError) as raised:
        loaderplug.hydrate(url, tmp_path / "local")
    assert "secret" not in str(raised.value) and "wJal" not in str(raised.value)


def test_a_key_with_dotdot_in_the_bucket_is_refused_and_nothing_lands_outside(
    s3: SeaweedS3, model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SeaweedFS refuses such keys (InvalidRequest); S3 stores them. The bucket's real
    # listing is given them on top.
    url = upload(s3, model, fresh_prefix())
    real_list = ObjectStore.list
    hostile = ["../escape", "sub/../../escape", "./dot", "a//b", "/abs"]

    def with_hostile_keys(store: ObjectStore, prefix: str) -> list[ObjectInfo]:
        found = real_list(store, prefix)
        return found + [ObjectInfo(rel, 1, '"e"', found[0].mtime_ns) for rel in hostile]

    monkeypatch.setattr(ObjectStore, "list", with_hostile_keys)
    report = loaderplug.hydrate(url, tmp_path / "out" / "local", check=False, **OBJECT_FAST)
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"local"}
    assert tree_bytes(tmp_path / "out" / "local") == tree_bytes(model)
    assert sorted(r.path for r in report.failed) == sorted(hostile)
    assert all("refused" in r.reason or "not a plain" in r.reason for r in report.failed)


def test_a_read_of_an_object_fails_the_file_not_the_process(
    uploaded: tuple[Path, str], proxy: ObjectProxy, tmp_path: Path
) -> None:
    folder, url = uploaded
    proxy.add(Fault("slowdown", key="model-00001", times=1000))
    report = loaderplug.hydrate(
        url, tmp_path / "local", check=False, **{**OBJECT_FAST, "retry_attempts": 2}
    )
    assert [r.path for r in report.failed] == ["model-00001-of-00003.safetensors"]
    assert "slow down" in report.failed[0].reason
    proxy.faults.clear()
    assert loaderplug.hydrate(url, tmp_path / "local", **OBJECT_FAST).ok
    assert same_tree(folder, tmp_path / "local")


@pytest.mark.parametrize("one_pass", [False, True], ids=["stream", "one-pass"])
def test_ranks_of_a_host_read_each_object_once_and_every_rank_gets_every_tensor(
    uploaded: tuple[Path, str], proxy: ObjectProxy, tmp_path: Path, one_pass: bool
) -> None:
    pytest.importorskip("torch")
    from tests.helpers.ranks import expected, run_ranks

    folder, url = uploaded
    shards = sorted(folder.glob("*.safetensors"))
    env = {**{k: os.environ[k] for k in os.environ if k.startswith("AWS_")}}
    if one_pass:
        env["RANK_LOCAL_DIR"] = str(tmp_path / "local")
    outs, _ = run_ranks(tmp_path, [f"{url}/{p.name}" for p in shards], 2, env=env)
    want = expected(shards)
    for out in outs:
        assert out.get("error") is None, out
        assert out["tensors"] == want
    model_bytes = sum(p.stat().st_size for p in shards)
    # Each object read once by the host (headers aside), whichever rank reads it.
    assert model_bytes <= proxy.body_bytes <= model_bytes + 64 * 1024 * len(shards)
    if one_pass:
        for p in shards:
            assert filecmp.cmp(p, tmp_path / "local" / p.name, shallow=False)


def test_a_sync_the_store_refuses_leaves_no_partial_object_and_a_rerun_completes(
    s3: SeaweedS3, proxy: ObjectProxy, tmp_path: Path
) -> None:
    folder = tmp_path / "model"
    write_model(folder, 40 << 20, 2)  # shards above one part: multipart uploads
    url = f"s3://{BUCKET}/{fresh_prefix()}"
    proxy.add(Fault("slowdown", key="uploadId", method="PUT", ranged=False, times=10**6))
    report = loaderplug.sync(folder, url, check=False, **OBJECT_FAST)
    assert sorted(r.path for r in report.failed) == sorted(
        p.name for p in folder.glob("*.safetensors")
    )
    assert all("slow down" in r.reason for r in report.failed)
    client = s3.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=key_of(url))["Contents"]]
    assert not any(k.endswith(".safetensors") for k in keys)  # nothing half written
    assert client.list_multipart_uploads(Bucket=BUCKET, Prefix=key_of(url)).get("Uploads", []) == []
    # The hydrate refuses what the manifest says failed; the next sync completes it.
    hydrated = loaderplug.hydrate(url, tmp_path / "h1", check=False, **OBJECT_FAST)
    assert {r.path for r in hydrated.failed} == {r.path for r in report.failed}
    proxy.faults.clear()
    assert loaderplug.sync(folder, url, **OBJECT_FAST).ok
    loaderplug.hydrate(url, tmp_path / "h2", **OBJECT_FAST)
    assert tree_bytes(tmp_path / "h2") == tree_bytes(folder)


def journaled_spans(folder: Path) -> int:
    """Spans the journals under ``folder`` say landed (their lines past the header)."""
    return sum(len(j.read_text().splitlines()) - 1 for j in folder.glob(f".*{JOURNAL_SUFFIX}"))


def test_a_killed_hydrate_resumes_from_what_landed(
    s3: SeaweedS3, proxy: ObjectProxy, tmp_path: Path
) -> None:
    folder = tmp_path / "model"
    write_model(folder, 8 << 20, 1)
    url = upload(s3, folder, fresh_prefix())
    (shard,) = folder.glob("*.safetensors")
    # The shard's first span lands; every later one hangs until the process is killed.
    proxy.add(Fault("hang", key=shard.name, skip=1, times=10**6, hang_s=120))
    env = {**os.environ, "LOADERPLUG_SPAN_BYTES": "1M", "LOADERPLUG_READERS": "2"}
    env["LOADERPLUG_SPLIT_THRESHOLD_BYTES"] = "2M"
    code = f"import loaderplug; loaderplug.hydrate({url!r}, {str(tmp_path / 'local')!r})"
    child = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        deadline = time.monotonic() + 60
        while not journaled_spans(tmp_path / "local") and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        child.kill()
        child.wait()
    proxy.faults.clear()
    before = proxy.body_bytes
    report = loaderplug.hydrate(url, tmp_path / "local", **OBJECT_FAST)
    assert report.ok and tree_bytes(tmp_path / "local") == tree_bytes(folder)
    # Only what had not landed was read again (and the listing's few KiB of XML).
    model_bytes = sum(len(b) for b in tree_bytes(folder).values())
    assert proxy.body_bytes - before <= model_bytes - (1 << 20) + 64 * 1024


def test_the_command_line_hydrates_loads_and_diagnoses_a_bucket_without_showing_a_secret(
    uploaded: tuple[Path, str], tmp_path: Path
) -> None:
    folder, url = uploaded

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["loaderplug", *args], capture_output=True, text=True, timeout=120, env=dict(os.environ)
        )

    hydrated = cli("hydrate", "--from", url, "--to", str(tmp_path / "h"), "--json")
    assert hydrated.returncode == 0, hydrated.stderr
    assert tree_bytes(tmp_path / "h") == tree_bytes(folder)
    loaded = cli("load", "--from", url, "--to", str(tmp_path / "l"), "--json")
    assert loaded.returncode == 0, loaded.stderr
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert sorted(json.loads(loaded.stdout)["io"]) == [f"{url}/{n}" for n in shards]
    assert tree_bytes(tmp_path / "l") == {n: (folder / n).read_bytes() for n in shards}
    doctor = cli("doctor", url)
    assert doctor.returncode == 0 and f"{url}: s3 object store" in doctor.stdout
    assert "5 objects" in doctor.stdout
    secret = os.environ["AWS_SECRET_ACCESS_KEY"]
    for done in (hydrated, loaded, doctor):
        assert secret not in done.stdout + done.stderr
    bad = subprocess.run(
        ["loaderplug", "hydrate", "--from", url, "--to", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "AWS_SECRET_ACCESS_KEY": "wrong-secret-77"},
    )
    assert bad.returncode == 1 and "access denied" in bad.stderr and url in bad.stderr
    assert "wrong-secret-77" not in bad.stderr + bad.stdout


def test_a_second_load_into_the_same_local_dir_reads_the_local_copies(
    uploaded: tuple[Path, str], proxy: ObjectProxy, tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    folder, url = uploaded
    urls = [f"{url}/{p.name}" for p in sorted(folder.glob("*.safetensors"))]
    first = loaderplug.iter_tensors(urls, local_dir=tmp_path / "local", **OBJECT_FAST)
    names = sorted(name for name, _ in first)
    before = proxy.body_bytes
    again = loaderplug.iter_tensors(urls, local_dir=tmp_path / "local", **OBJECT_FAST)
    assert sorted(name for name, _ in again) == names
    assert proxy.body_bytes == before  # a HEAD per object, no byte of it
    assert all("local copy" in mode for mode in again.io_modes.values()), again.io_modes


def test_a_hydrate_waits_for_a_first_sync_and_never_copies_half_a_model(
    s3: SeaweedS3, model: Path, tmp_path: Path
) -> None:
    url = upload(s3, model, fresh_prefix())
    # A sync under way: its fresh mark, no manifest yet.
    s3.client().put_object(Bucket=BUCKET, Key=f"{key_of(url)}/.loaderplug-sync", Body=b"{}")
    with pytest.raises(MirrorError, match="a sync is writing"):
        loaderplug.hydrate(url, tmp_path / "local", **OBJECT_FAST, sync_wait_s=2)
    assert not (tmp_path / "local").exists() or tree_bytes(tmp_path / "local") == {}


def test_a_folder_marker_in_the_bucket_is_no_file(
    s3: SeaweedS3, model: Path, tmp_path: Path
) -> None:
    (model / "sub" / "deeper").mkdir(parents=True)
    (model / "sub" / "deeper" / "tokenizer.json").write_text("{}")
    url = upload(s3, model, fresh_prefix())
    for marker in ("sub/", "sub/deeper/"):  # as a console's "create folder" makes them
        s3.client().put_object(Bucket=BUCKET, Key=f"{key_of(url)}/{marker}", Body=b"")
    report = loaderplug.hydrate(url, tmp_path / "local", **OBJECT_FAST)
    assert report.ok and tree_bytes(tmp_path / "local") == tree_bytes(model)


def test_an_object_replaced_in_the_same_second_with_the_same_size_is_copied_again(
    s3: SeaweedS3, model: Path, tmp_path: Path
) -> None:
    url = upload(s3, model, fresh_prefix())
    name = "config.json"
    loaderplug.hydrate(url, tmp_path / "local", **OBJECT_FAST)
    other = bytes(reversed((model / name).read_bytes()))  # same size, other bytes
    s3.client().put_object(Bucket=BUCKET, Key=f"{key_of(url)}/{name}", Body=other)
    # As if in the same second: the copy's time is the new object's Last-Modified, so
    # size and time match; only the version (the ETag) tells them apart.
    info = store_for(ObjectURL.parse(url), 5).head(f"{key_of(url)}/{name}")
    os.utime(tmp_path / "local" / name, ns=(info.mtime_ns, info.mtime_ns))
    report = loaderplug.hydrate(url, tmp_path / "local", **OBJECT_FAST)
    assert [r.path for r in report.restored] == [name]
    assert (tmp_path / "local" / name).read_bytes() == other
