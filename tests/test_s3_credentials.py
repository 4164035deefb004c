"""S3 without credentials, from Python: tsckpt's line says what to check, and the AWS SDK's lines stay off stderr.

Without ``AWS_ACCESS_KEY_ID`` TensorStore asks the AWS SDK's default
credentials chain, which logs every source it finds empty straight to file
descriptor 2. The requests then go unsigned, and the moto server refuses
them as S3 refuses an anonymous request to a private bucket.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch

import tsckpt
from tsckpt.native_logs import is_aws_sdk_line, quiet
from tsckpt.storage.hints import hint

BUCKET = "tsckpt-credentials"  # this module's bucket on the run's moto server (the s3 fixture, conftest.py)
REFUSED = ("the store refused the request: check the credentials (none found: set AWS_ACCESS_KEY_ID and "
           "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) and the endpoint")


def _without_credentials(tmp_path) -> dict[str, str]:
    """An environment where the AWS chain finds nothing: no AWS_* variables, a home without ~/.aws."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "TSCKPT_NATIVE_LOGS"}
    env["HOME"] = str(tmp_path / "home")
    (tmp_path / "home").mkdir()
    return env


def test_every_python_call_says_what_to_check_and_keeps_the_sdk_lines_off_stderr(s3, tmp_path):
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
    args = json.dumps([committed, s3.location(BUCKET, "run/step_2"), s3.location(BUCKET, "run")])
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code), args], capture_output=True, text=True,
                            env=_without_credentials(tmp_path), timeout=240)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["save", "open", "load", "latest"], result.stdout
    for line in lines:
        assert "PERMISSION_DENIED" in line and line.endswith(REFUSED), line
    assert result.stderr == "", result.stderr


def test_the_hint_names_no_aws_setting_for_a_local_file_or_another_store():
    assert hint("PERMISSION_DENIED: Unknown [x-amzn-requestid='abc']", {}) == REFUSED
    assert hint("PERMISSION_DENIED: Error opening file: /ck/zarr.json [os_error_code=13]", {}) is None
    assert hint("PERMISSION_DENIED: Forbidden", {}) == "the store refused the request: check the credentials and " \
                                                        "the endpoint"


def test_a_rank_that_could_not_write_says_what_to_check(monkeypatch, tmp_path):
    from tsckpt.dcp.failure import RankFailure
    from tsckpt.errors import StorageError

    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))

    try:
        try:
            raise ValueError("PERMISSION_DENIED: AccessDenied: Access Denied [x-amz-request-id='1']")
        except ValueError as e:  # how the rank's writer reports a refused write: the gist, from the request's error
            raise StorageError("AccessDenied: Access Denied writing 'model.w'") from e
    except StorageError as e:
        failure = RankFailure.of(3, e)
    assert failure.problem == f"AccessDenied: Access Denied writing 'model.w'; {REFUSED}"


def test_only_the_aws_sdk_lines_are_dropped():
    dropped = [b"E1123 18:32:15.330546   16201 common-io:5] static: Failed to open file.",
               b"E1125 19:03:20.645179   26011 aws_api.cc:6148] (id=0x55eb) IMDS client failed to update the token",
               b"E1125 19:03:20.643266   25984 AuthCredentialsProvider:6146] static: Profile credentials parser"]
    kept = [b"F1125 19:03:20.645179   26011 aws_api.cc:6148] a fatal error ends the process: it is shown",
            b"E1125 19:03:20.645179   26011 s3_key_value_store.cc:312] TensorStore's own error",
            b"Traceback (most recent call last):"]
    assert [is_aws_sdk_line(x) for x in dropped + kept] == [True] * 3 + [False] * 3


def test_the_window_passes_everything_else_in_order_and_gives_stderr_back(tmp_path):
    code = r"""
        import os, sys
        from tsckpt.native_logs import quiet
        print("before", file=sys.stderr, flush=True)
        with quiet("s3://some-bucket/run/step_1"):
            os.write(2, b"E1123 18:32:15.330546   16201 common-io:5] static: Failed to open file.\n")
            os.write(2, b"F0101 00:00:00.000001 7 aws_api.cc:6148] fatal\nkept from C++\n")
            print("kept from Python", file=sys.stderr, flush=True)
        print("after", file=sys.stderr, flush=True)
        os.write(2, b"E1123 18:32:15.330546   16201 common-io:5] outside a window: the caller's stderr\n")
        """
    env = _without_credentials(tmp_path)
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        "before", "F0101 00:00:00.000001 7 aws_api.cc:6148] fatal", "kept from C++", "kept from Python", "after",
        "E1123 18:32:15.330546   16201 common-io:5] outside a window: the caller's stderr"]
    shown = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                           env={**env, "TSCKPT_NATIVE_LOGS": "1"}, timeout=60)
    assert "static: Failed to open file." in shown.stderr


def test_a_crash_in_the_window_still_reaches_stderr(tmp_path):
    code = r"""
        import os
        from tsckpt.native_logs import quiet
        with quiet("s3://some-bucket/run/step_1"):
            os.write(2, b"terminate called without an active exception\n")
            os.abort()
        """
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            env=_without_credentials(tmp_path), timeout=60)
    assert result.returncode != 0
    assert "terminate called without an active exception" in result.stderr


def test_no_window_where_nothing_would_be_logged(monkeypatch):
    before = os.fstat(2)
    for location, environ in (("/tmp/ck", {}), ("s3://some-bucket/ck", {"AWS_ACCESS_KEY_ID": "x"}),
                              ("s3://some-bucket/ck", {"TSCKPT_NATIVE_LOGS": "1"})):
        for name, value in environ.items():
            monkeypatch.setenv(name, value)
        with quiet(location):
            assert os.path.samestat(os.fstat(2), before), location
        for name in environ:
            monkeypatch.delenv(name)
