"""S3 credentials: one source, named to TensorStore, so the AWS SDK logs nothing; tsckpt's line says what to check.

Left to itself, TensorStore asks the AWS SDK's default chain, which logs every
source it finds empty straight to file descriptor 2. tsckpt names the one
source that applies (:mod:`tsckpt.storage.credentials`) and leaves stderr alone.
Without credentials the requests go unsigned, and the moto server refuses them
as S3 refuses an anonymous request to a private bucket.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tsckpt
from s3server import CREDENTIALS
from tsckpt.storage.credentials import on_ec2, resolve
from tsckpt.storage.kvio import hint

BUCKET = "tsckpt-credentials"  # this module's bucket on the run's moto server (the s3 fixture, conftest.py)
REFUSED = ("the store refused the request: check the credentials (none found: set AWS_ACCESS_KEY_ID and "
           "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) and the endpoint")
#: Nothing here is an EC2 instance, whatever machine runs the tests.
NO_IMDS = {"AWS_EC2_METADATA_DISABLED": "true"}


def _without_credentials(tmp_path) -> dict[str, str]:
    """An environment where no source has credentials: no AWS_* variables, a home without ~/.aws, no IMDS."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["HOME"] = str(tmp_path / "home")
    (tmp_path / "home").mkdir(exist_ok=True)
    return env | NO_IMDS


def _run(code: str, args: object, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), json.dumps(args)], capture_output=True,
                          text=True, env=env, timeout=240)


def test_every_python_call_says_what_to_check_and_writes_nothing_to_stderr(s3, tmp_path):
    committed = s3.location(BUCKET, "run/step_1")
    tsckpt.save({"w": torch.ones(4)}, committed)  # with the fixture's credentials
    code = """
        import json, sys, torch, tsckpt
        committed, fresh, root = json.loads(sys.argv[1])
        calls = {
            "save": lambda: tsckpt.save({"w": torch.ones(4)}, fresh),
            "open": lambda: tsckpt.open(committed),
            "load": lambda: tsckpt.load({"w": torch.zeros(4)}, committed),
            "latest": lambda: tsckpt.latest(root),
        }
        for name, call in calls.items():
            try:
                call()
                print(name, "returned")
            except tsckpt.TsckptError as e:
                print(name, str(e))
        """
    result = _run(code, [committed, s3.location(BUCKET, "run/step_2"), s3.location(BUCKET, "run")],
                  _without_credentials(tmp_path))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["save", "open", "load", "latest"], result.stdout
    for line in lines:
        assert "PERMISSION_DENIED" in line and line.endswith(REFUSED), line
    assert result.stderr == "", result.stderr


def test_keys_in_a_profile_are_used_and_the_sdk_logs_nothing(s3, tmp_path):
    # TensorStore's default chain finds no profile in ~/.aws here (0.1.86); named with its files, it does.
    env = _without_credentials(tmp_path) | {"AWS_PROFILE": "train"}
    (tmp_path / "home" / ".aws").mkdir()
    (tmp_path / "home" / ".aws" / "config").write_text(
        "[profile train]\nregion = us-east-1\naws_access_key_id = {AWS_ACCESS_KEY_ID}\n"
        "aws_secret_access_key = {AWS_SECRET_ACCESS_KEY}\n".format(**CREDENTIALS))
    code = """
        import json, sys, torch, tsckpt
        [where] = json.loads(sys.argv[1])
        tsckpt.save({"w": torch.arange(4.0)}, where)
        out = {"w": torch.zeros(4)}
        tsckpt.load(out, where)
        print(out["w"].tolist())
        """
    result = _run(code, [s3.location(BUCKET, "profile/step_1")], env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[0.0, 1.0, 2.0, 3.0]\n"
    assert result.stderr == "", result.stderr


def test_a_source_that_gives_no_keys_says_which_it_was(s3, monkeypatch):
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")  # the environment's keys, half of them
    with pytest.raises(tsckpt.TsckptError) as e:
        tsckpt.open(s3.location(BUCKET, "run/step_1"))
    assert str(e.value).endswith("no AWS credentials from AWS_ACCESS_KEY_ID from the environment: check them, or "
                                 "name another source as the location's context resource aws_credentials"), e.value


def test_each_source_is_named_alone(tmp_path):
    home, sysfs = tmp_path / "home", tmp_path / "sys"
    (home / ".aws").mkdir(parents=True)
    base = {"HOME": str(home)} | NO_IMDS
    assert resolve(base).spec == {"type": "anonymous"} and resolve(base).source is None
    assert resolve(base | {"AWS_ACCESS_KEY_ID": "k"}).spec == {"type": "environment"}
    assert resolve(base | {"AWS_CONTAINER_CREDENTIALS_FULL_URI": "http://127.0.0.1:1/c"}).spec == {"type": "ecs"}
    assert resolve(base | {"AWS_WEB_IDENTITY_TOKEN_FILE": "/t"}).spec == {"type": "default"}
    assert resolve(base | {"AWS_PROFILE": "none-such"}).spec == {"type": "default", "profile": "none-such"}

    (home / ".aws" / "credentials").write_text("[default]\naws_access_key_id = k\naws_secret_access_key = s\n")
    assert resolve(base).spec == {"type": "profile", "profile": "default", "credentials_file":
                                  str(home / ".aws" / "credentials"), "config_file": os.devnull}
    (home / ".aws" / "config").write_text("[profile role]\nrole_arn = arn:aws:iam::1:role/r\nsource_profile = default\n")
    assert resolve(base | {"AWS_PROFILE": "role"}).spec == {"type": "default", "profile": "role"}  # the SDK assumes it
    assert resolve(base | {"AWS_ACCESS_KEY_ID": "k"}).spec == {"type": "environment"}  # the chain's order

    (sysfs / "devices/virtual/dmi/id").mkdir(parents=True)
    assert not on_ec2(str(sysfs))
    (sysfs / "devices/virtual/dmi/id/sys_vendor").write_text("Amazon EC2\n")
    bare = {"HOME": str(tmp_path / "nobody")}
    assert resolve(bare, str(sysfs)).spec == {"type": "imds"}
    assert resolve(bare | NO_IMDS, str(sysfs)).spec == {"type": "anonymous"}


def test_the_hint_names_no_aws_setting_for_a_local_file_or_another_store(tmp_path):
    nothing = {"HOME": str(tmp_path)} | NO_IMDS
    assert hint("PERMISSION_DENIED: Unknown [x-amzn-requestid='abc']", nothing) == REFUSED
    assert hint("PERMISSION_DENIED: Error opening file: /ck/zarr.json [os_error_code=13]", nothing) is None
    assert hint("PERMISSION_DENIED: Forbidden", nothing) == "the store refused the request: check the credentials " \
                                                            "and the endpoint"


def test_a_rank_that_could_not_write_says_what_to_check(monkeypatch, tmp_path):
    from tsckpt.dcp.failure import RankFailure
    from tsckpt.errors import StorageError

    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")

    try:
        try:
            raise ValueError("PERMISSION_DENIED: AccessDenied: Access Denied [x-amz-request-id='1']")
        except ValueError as e:  # how the rank's writer reports a refused write: the gist, from the request's error
            raise StorageError("AccessDenied: Access Denied writing 'model.w'") from e
    except StorageError as e:
        failure = RankFailure.of(3, e)
    assert failure.problem == f"AccessDenied: Access Denied writing 'model.w'; {REFUSED}"
