"""Credentials never reach a message: every text a user, a log line or the run store sees can pass
through `redact_text`, the one place that knows what a credential looks like in text.

Configs hold secrets only as references (`env:NAME`, `file:/path`), but a value can still carry
one by mistake or by design elsewhere: a URL with a password (`s3://key:secret@bucket`,
`postgresql://user:pw@host/db`, `https://user:pw@host/model`), a libpq DSN with `password=...`,
a signed URL's `X-Amz-Signature=...`, an `Authorization: Bearer ...` header. The patterns below
over-redact rather than under-redact: `https://host:8080/a@b` loses its port to `***`, which
costs a reader a little and can never leak anything.

Standard library only: every layer (config, errors, storage, runtime, server) imports this.
"""

from __future__ import annotations

import re
from typing import Any

MASK = "***"

# scheme://user:password@  (user may be empty: redis://:pw@host). The password runs to the
# last '@' before whitespace or a quote, so an unencoded '@' or '/' inside it is covered too.
# One slash counts too: a URL passed through a path type comes out as scheme:/user:pw@host.
_URL_PASSWORD = re.compile(
    r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*:/{1,2}[^\s/@:'\"<>]*:)(?P<secret>[^\s'\"<>]*)@"
)
# key=value pairs: libpq DSNs (`password=x`), query strings (`?token=x&...`), env dumps.
_SECRET_KEYS = (
    r"password|passwd|pwd|secret|token|api[_-]?key|access[_-]?key|secret[_-]?key|"
    r"x-amz-signature|x-amz-credential|x-goog-signature|signature|sig|credential"
)
_KEY_VALUE = re.compile(
    rf"(?P<head>(?:^|(?<=[\s?&;,{{(\"']))(?:{_SECRET_KEYS})\s*=\s*)"
    r"(?P<secret>'[^']*'|\"[^\"]*\"|[^\s&;,'\"})]+)",
    re.IGNORECASE,
)
_BEARER = re.compile(r"(?P<head>\b(?:Bearer|Basic|Token)\s+)(?P<secret>[A-Za-z0-9\-._~+/]{8,}=*)")


def redact_text(text: str) -> str:
    """`text` with every credential it carries replaced by ``***``; the rest unchanged."""
    if not text:
        return text
    text = _URL_PASSWORD.sub(lambda m: f"{m['head']}{MASK}@", text)
    text = _KEY_VALUE.sub(lambda m: f"{m['head']}{MASK}", text)
    return _BEARER.sub(lambda m: f"{m['head']}{MASK}", text)


def redact_value(value: Any) -> Any:
    """`value` with every string inside it (in lists, tuples and dicts too) redacted."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, list | tuple):
        return type(value)(redact_value(item) for item in value)
    if isinstance(value, dict):
        return {redact_value(key): redact_value(item) for key, item in value.items()}
    return value
