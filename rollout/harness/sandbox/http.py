"""HTTP with an egress allow-list: GET and POST to allowed hosts only.

A host is allowed when it equals an entry or, for an entry ``*.example.com``, ends with
``.example.com``. Hosts are compared as written in the URL after lower-casing: an IP literal is
allowed only when that literal is on the list, so ``2130706433`` or ``127.1`` never pass for
``127.0.0.1``. A named host must resolve to public addresses (no loopback, private, link-local
or reserved address, unless allow_private_addresses), and the connection goes to the address that
was checked, so a second DNS answer cannot redirect it. Redirects are followed only to allowed
hosts, each checked the same way. Proxies from the environment are never used.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from urllib.parse import urljoin, urlsplit

from rollout.harness.sandbox.process import Refused

_REDIRECTS = (301, 302, 303, 307, 308)


@dataclass(frozen=True)
class HttpResult:
    """status: the final response's status; body: at most max_response_bytes of it (truncated
    says whether there was more); failure: a network error or timeout, then status is 0."""

    url: str
    status: int
    body: bytes
    truncated: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    failure: str | None = None

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")


class HttpEgress:
    def __init__(
        self,
        allowed_hosts: Iterable[str],
        *,
        timeout_s: float = 10.0,
        max_response_bytes: int = 1 << 20,
        max_redirects: int = 5,
        allow_private_addresses: bool = False,
    ):
        self.allowed = tuple(_entry(host) for host in allowed_hosts)
        self.timeout_s = timeout_s
        self.max_response_bytes = max_response_bytes
        self.max_redirects = max_redirects
        self.allow_private_addresses = allow_private_addresses

    def get(self, url: str, headers: Mapping[str, str] | None = None) -> HttpResult:
        return self.request("GET", url, headers=headers)

    def post(
        self, url: str, body: bytes | str = b"", headers: Mapping[str, str] | None = None
    ) -> HttpResult:
        return self.request("POST", url, body=body, headers=headers)

    def request(
        self,
        method: str,
        url: str,
        *,
        body: bytes | str = b"",
        headers: Mapping[str, str] | None = None,
    ) -> HttpResult:
        """Refused when the URL (or a redirect) is not allowed; network trouble is a result."""
        if method not in ("GET", "POST"):
            raise Refused(f"method {method!r} is not allowed (GET or POST)")
        data = body.encode() if isinstance(body, str) else bytes(body)
        for _ in range(self.max_redirects + 1):
            host, port, address, target, https = self._check(url)
            try:
                status, reply_headers, content, truncated = self._once(
                    method, host, port, address, target, https, data, dict(headers or {})
                )
            except (OSError, http.client.HTTPException) as error:
                return HttpResult(url, 0, b"", failure=f"{type(error).__name__}: {error}")
            location = reply_headers.get("location")
            if status not in _REDIRECTS or not location:
                return HttpResult(url, status, content, truncated, reply_headers)
            url = urljoin(url, location)
            if status == 303 or (status in (301, 302) and method == "POST"):
                method, data = "GET", b""
        raise Refused(f"more than {self.max_redirects} redirects")

    def _check(self, url: str) -> tuple[str, int, str, str, bool]:
        """(host, port, the address to connect to, request target, https) or Refused."""
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as error:
            raise Refused(f"{url!r} is not a usable URL: {error}") from None
        if parts.scheme not in ("http", "https"):
            raise Refused(f"{url!r}: only http and https URLs are allowed")
        if parts.username is not None or parts.password is not None:
            raise Refused(f"{url!r}: credentials in URLs are not allowed")
        host = (parts.hostname or "").rstrip(".").lower()
        if not host or not any(_matches(host, entry) for entry in self.allowed):
            raise Refused(f"the host {host!r} is not on the egress allow-list")
        https = parts.scheme == "https"
        port = port or (443 if https else 80)
        address = host if _is_ip(host) else self._public_address(host, port)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return host, port, address, target, https

    def _public_address(self, host: str, port: int) -> str:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as error:
            raise Refused(f"the host {host!r} does not resolve: {error}") from None
        addresses = [info[4][0] for info in infos]
        if not self.allow_private_addresses:
            private = [a for a in addresses if not ipaddress.ip_address(a).is_global]
            if private:
                raise Refused(
                    f"the host {host!r} resolves to a non-public address ({private[0]}); "
                    "allow that address itself if it is meant"
                )
        return addresses[0]

    def _once(self, method, host, port, address, target, https, data, headers):
        if https:
            connection = http.client.HTTPSConnection(
                host, port, timeout=self.timeout_s, context=ssl.create_default_context()
            )
        else:
            connection = http.client.HTTPConnection(host, port, timeout=self.timeout_s)
        # connect to the checked address; the Host header and TLS name stay the host's
        connection._create_connection = lambda _addr, timeout, source: socket.create_connection(
            (address, port), timeout, source
        )
        try:
            connection.request(method, target, body=data or None, headers=headers)
            response = connection.getresponse()
            content = response.read(self.max_response_bytes + 1)
            reply_headers = {name.lower(): value for name, value in response.getheaders()}
            truncated = len(content) > self.max_response_bytes
            return response.status, reply_headers, content[: self.max_response_bytes], truncated
        finally:
            connection.close()


def _entry(host: str) -> str:
    entry = host.strip().rstrip(".").lower()
    name = entry.removeprefix("*.")
    if not name or "*" in name or "/" in name or (":" in name and not _is_ip(name)):
        raise ValueError(f"allowed hosts are names, '*.domain' or IP addresses, got {host!r}")
    return entry


def _matches(host: str, entry: str) -> bool:
    if entry.startswith("*."):
        return not _is_ip(host) and host.endswith(entry[1:])
    return host == entry


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
