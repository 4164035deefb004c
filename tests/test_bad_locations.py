"""Wrong paths and unreachable stores: one clear line and a non-zero exit, never a traceback or a hang.

Each case goes through the Python API and the command line. The S3 cases that
need a server live in ``test_s3.py`` (a real moto server); here the endpoint is
a closed port on loopback, which refuses every connection.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tsckpt
from cli_run import one_line_error, run_cli as cli
from tsckpt.errors import NotACheckpointError, StorageError, TsckptError
from tsckpt.storage.context import DEFAULT_S3_RETRIES, context_spec
from tsckpt.storage.kvio import S3_RETRIES_ENV
from tsckpt.storage.location import parse_location

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2)}, path)
    return path


def test_regular_file_is_not_a_checkpoint_directory(a_file):
    message = f"{a_file} is a file, not a checkpoint directory"
    with pytest.raises(NotACheckpointError, match=message):
        tsckpt.open(a_file)
    with pytest.raises(NotACheckpointError, match=message):
        tsckpt.load({"w": torch.zeros(2)}, a_file)
    with pytest.raises(NotACheckpointError, match=message):
        tsckpt.save({"w": torch.zeros(2)}, a_file)
    assert message in one_line_error(cli("ls", str(a_file)))


def test_path_below_a_regular_file_is_refused(a_file):
    with pytest.raises(NotACheckpointError, match="is a file, not a directory"):
        tsckpt.open(a_file / "inner")
    assert "is a file, not a directory" in one_line_error(cli("info", str(a_file / "inner")))


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dcp") / "ckpt"
    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(path))  # FileSystemWriter: .metadata + __0_0.distcp
    assert (path / ".metadata").exists() and (path / "__0_0.distcp").exists()
    return path


def test_dcp_filesystem_checkpoint_is_named_and_pointed_to_convert(dcp_dir):
    message = rf"{dcp_dir} is a DCP FileSystemWriter checkpoint.*`tsckpt convert --trust-pickle {dcp_dir} DST`"
    with pytest.raises(NotACheckpointError, match=message):
        tsckpt.open(dcp_dir)
    with pytest.raises(NotACheckpointError, match=message):
        tsckpt.load({"w": torch.zeros(4)}, dcp_dir)
    with pytest.raises(BaseException, match="DCP FileSystemWriter checkpoint"):
        dcp.load({"w": torch.zeros(4)}, storage_reader=tsckpt.TensorStoreReader(dcp_dir))
    for command in ("ls", "verify"):
        assert "DCP FileSystemWriter checkpoint" in one_line_error(cli(command, str(dcp_dir)))


def test_the_convert_it_points_to_works(dcp_dir, tmp_path):
    out = tmp_path / "converted"
    result = cli("convert", "--trust-pickle", str(dcp_dir), str(out))
    assert result.returncode == 0, result.stderr
    sd = {"w": torch.zeros(4)}
    tsckpt.load(sd, out)
    assert torch.equal(sd["w"], torch.arange(4.0))


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_s3_endpoint_gives_up_with_a_clear_error(monkeypatch):
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    endpoint = f"http://127.0.0.1:{closed_port()}"
    location = {"url": "s3://bucket/run", "endpoint": endpoint,
                "context": {"s3_request_retries": {"max_retries": 1, "initial_delay": "10ms"}}}
    refused = rf"s3://bucket/run.*gave up after 1 retry.*nothing answers at 127\.0\.0\.1:\d+: check the endpoint"
    with pytest.raises(StorageError, match=refused):
        tsckpt.open(location)
    with pytest.raises(StorageError, match="gave up after 1 retry"):
        tsckpt.save({"w": torch.zeros(2)}, location)
    line = one_line_error(cli("ls", "s3://bucket/run",
                              env={**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint, S3_RETRIES_ENV: "1"}))
    assert "s3://bucket/run" in line and "gave up after 1 retry" in line and "Could not connect" in line
    assert "check the endpoint (AWS_ENDPOINT_URL" in line


def test_the_command_line_gives_up_on_an_unknown_host_within_a_few_retries():
    # An endpoint whose host cannot resolve (".invalid" never does): the command line retries twice,
    # not the library's six times over a minute, and says which host it tried.
    line = one_line_error(cli("ls", "s3://bucket/run", env={**CREDENTIALS,
                                                             "AWS_ENDPOINT_URL": "http://no-such-host.invalid:9000"}))
    assert line.startswith("error: cannot read 'zarr.json' at s3://bucket/run: gave up after 2 retries")
    assert "cannot resolve no-such-host.invalid: check the endpoint's host name and the network" in line


def test_s3_errors_name_the_endpoint_or_the_credentials_behind_them(tmp_path):
    from tsckpt.storage.kvio import hint

    dns = "CURL error Could not resolve hostname: Could not resolve host: bucket.s3.amazonaws.com"
    assert hint(dns, {"AWS_ACCESS_KEY_ID": "k"}) == (
        "cannot resolve bucket.s3.amazonaws.com: without an endpoint, s3:// goes to AWS; to reach another S3 "
        "server set AWS_ENDPOINT_URL, AWS_ENDPOINT_URL_S3 or 'endpoint' in a JSON location")
    nowhere = {"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"), "AWS_CONFIG_FILE": str(tmp_path / "none"),
               "AWS_EC2_METADATA_DISABLED": "true"}
    assert hint(dns, nowhere).endswith("; no AWS credentials were found either (set AWS_ACCESS_KEY_ID and "
                                       "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)")
    denied = "PERMISSION_DENIED: AccessDenied: Access Denied"
    assert hint(denied, nowhere) == ("the store refused the request: check the credentials (none found: set "
                                     "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) and the endpoint")
    assert "(using profile 'ml' (AWS_PROFILE))" in hint("SignatureDoesNotMatch", {"AWS_PROFILE": "ml"})
    (tmp_path / "credentials").write_text("[default]\n")
    assert f"using the default profile of {tmp_path / 'credentials'}" in hint(
        denied, {"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials")})
    assert hint("NOT_FOUND: something else", nowhere) is None


def test_s3_retries_default_to_about_a_minute_and_follow_the_environment(monkeypatch):
    s3 = parse_location("s3://bucket/run")
    monkeypatch.delenv(S3_RETRIES_ENV, raising=False)
    assert context_spec(location=s3)["s3_request_retries"] == {
        "max_retries": DEFAULT_S3_RETRIES, "initial_delay": "1s", "max_delay": "16s"}
    monkeypatch.setenv(S3_RETRIES_ENV, "3")
    assert context_spec(location=s3)["s3_request_retries"]["max_retries"] == 3
    assert "s3_request_retries" not in context_spec(location=parse_location("/tmp/x"))
    monkeypatch.setenv(S3_RETRIES_ENV, "soon")
    with pytest.raises(TsckptError, match=f"{S3_RETRIES_ENV}='soon'"):
        context_spec(location=s3)
