"""What to change when a request to an object store fails: the endpoint, or the credentials.

TensorStore's error says what went wrong at the HTTP level ("Could not resolve
host", "AccessDenied"); a user needs to know which setting to look at. An
``s3://`` location without an endpoint goes to AWS, which on a machine without
AWS access fails to resolve or connect; a refusal comes from credentials
that are missing or wrong. :func:`hint` names the setting, and where tsckpt
found credentials, if anywhere. Torch-free.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from . import credentials

#: The ways to point an ``s3://`` location at another S3 server, for messages.
ENDPOINT_SETTINGS = "AWS_ENDPOINT_URL, AWS_ENDPOINT_URL_S3 or 'endpoint' in a JSON location"
#: S3's error codes for a request whose signature or identity was refused.
_REFUSED = re.compile(r"\b(AccessDenied|InvalidAccessKeyId|SignatureDoesNotMatch|ExpiredToken|InvalidToken|"
                      r"AuthorizationHeaderMalformed)\b")
#: How TensorStore reports HTTP 401 and 403 when the response names no S3 error code (``PERMISSION_DENIED:
#: Unknown``, as for an unsigned request without credentials).
_DENIED = re.compile(r"\b(PERMISSION_DENIED|UNAUTHENTICATED)\b")
#: A local file's refusal (``[os_error_code=13]``): permissions on disk, nothing credentials change.
_OS_ERROR = re.compile(r"os_error_code|OS error")
#: How TensorStore reports a credentials source that gave none (environment variables missing, a metadata
#: service or container endpoint that does not answer).
_NO_CREDENTIALS = re.compile(r"Failed to (get credentials from|create credentials) provider")
#: S3 responses carry Amazon's request-id headers; other stores' (GCS) do not.
_S3_RESPONSE = re.compile(r"x-amzn?-", re.IGNORECASE)


def credentials_source(environ: Mapping[str, str] = os.environ) -> str | None:
    """Where S3 requests take AWS credentials from here, in words; None when nowhere (unsigned requests)."""
    return credentials.resolve(environ).source


def hint(text: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """What to check, for a failed object-store request whose error text is ``text``; None if nothing specific."""
    host = re.search(r"Could not resolve host: ([^\s;:()\]]+)", text)
    if host:
        where = host.group(1)
        if where.endswith("amazonaws.com"):
            missing = "" if credentials_source(environ) else (
                "; no AWS credentials were found either (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "or AWS_PROFILE)")
            return (f"cannot resolve {where}: without an endpoint, s3:// goes to AWS; to reach another S3 "
                    f"server set {ENDPOINT_SETTINGS}{missing}")
        return f"cannot resolve {where}: check the endpoint's host name and the network"
    refused = re.search(r"Failed to connect to (\S+) port (\d+)", text)
    if refused:
        return f"nothing answers at {refused.group(1)}:{refused.group(2)}: check the endpoint ({ENDPOINT_SETTINGS})"
    if _NO_CREDENTIALS.search(text):
        source = credentials_source(environ) or "the source named in the location's context"
        return (f"no AWS credentials from {source}: check them, or name another source as the location's "
                f"context resource aws_credentials")
    denied = _DENIED.search(text) is not None and _OS_ERROR.search(text) is None
    if _REFUSED.search(text) or (denied and _S3_RESPONSE.search(text)):
        source = credentials_source(environ)
        found = f"using {source}" if source else ("none found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                                                  "or AWS_PROFILE")
        return f"the store refused the request: check the credentials ({found}) and the endpoint"
    if denied:
        return "the store refused the request: check the credentials and the endpoint"
    return None
