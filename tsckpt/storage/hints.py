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
#: S3 responses carry Amazon's request-id headers; other stores' (GCS) do not.
_S3_RESPONSE = re.compile(r"x-amzn?-", re.IGNORECASE)


def credentials_source(environ: Mapping[str, str] = os.environ) -> str | None:
    """Where the AWS credentials chain would find credentials here, in words; None when nowhere obvious.

    The chain's last resort, an EC2 instance's metadata service, cannot be
    asked without waiting for it, so it is not: None means "only that".
    """
    if environ.get("AWS_ACCESS_KEY_ID"):
        return "AWS_ACCESS_KEY_ID from the environment"
    if environ.get("AWS_PROFILE"):
        return f"profile {environ['AWS_PROFILE']!r} (AWS_PROFILE)"
    if environ.get("AWS_WEB_IDENTITY_TOKEN_FILE"):
        return "a web identity token (AWS_WEB_IDENTITY_TOKEN_FILE)"
    if environ.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") or environ.get("AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        return "the container's credentials endpoint"
    for name, default in (("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"), ("AWS_CONFIG_FILE", "~/.aws/config")):
        path = os.path.expanduser(environ.get(name) or default)
        if os.path.isfile(path):
            return f"the default profile of {path}"
    return None


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
    denied = _DENIED.search(text) is not None and _OS_ERROR.search(text) is None
    if _REFUSED.search(text) or (denied and _S3_RESPONSE.search(text)):
        source = credentials_source(environ)
        found = f"using {source}" if source else ("none found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                                                  "or AWS_PROFILE")
        return f"the store refused the request: check the credentials ({found}) and the endpoint"
    if denied:
        return "the store refused the request: check the credentials and the endpoint"
    return None
