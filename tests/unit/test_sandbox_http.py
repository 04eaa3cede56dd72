"""HTTP egress allow-list against a real http.server on 127.0.0.1."""

from __future__ import annotations

import http.server
import threading

import pytest

from rollout.harness.sandbox import HttpEgress, Refused


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/away":
            self._reply(302, b"", location="http://example.com/")
        elif self.path == "/home":
            self._reply(302, b"", location="/hello")
        elif self.path == "/big":
            self._reply(200, b"z" * 5000)
        else:
            self._reply(200, b"hello " + self.path.encode())

    def do_POST(self):
        length = int(self.headers.get("content-length", 0))
        self._reply(200, b"got " + self.rfile.read(length))

    def _reply(self, status, body, location=None):
        self.send_response(status)
        if location:
            self.send_header("Location", location)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def test_an_allowed_host_is_fetched(server):
    egress = HttpEgress(["127.0.0.1"], timeout_s=5)
    got = egress.get(server + "/hello?x=1")
    assert got.status == 200 and got.text == "hello /hello?x=1" and not got.truncated
    posted = egress.post(server + "/echo", body="data")
    assert posted.status == 200 and posted.text == "got data"


def test_a_redirect_within_the_host_is_followed(server):
    got = HttpEgress(["127.0.0.1"]).get(server + "/home")
    assert got.status == 200 and got.text == "hello /hello"


def test_a_redirect_to_another_host_is_refused(server):
    with pytest.raises(Refused, match=r"example\.com"):
        HttpEgress(["127.0.0.1"]).get(server + "/away")


def test_a_response_past_the_cap_is_truncated(server):
    got = HttpEgress(["127.0.0.1"], max_response_bytes=100).get(server + "/big")
    assert got.truncated and got.body == b"z" * 100


@pytest.mark.parametrize(
    "url",
    [
        "http://example.com/",  # not on the list
        "http://localhost:{port}/",  # a name for 127.0.0.1 is not the allowed literal
        "http://2130706433:{port}/",  # 127.0.0.1 as one integer
        "http://127.1:{port}/",
        "http://0x7f.0.0.1:{port}/",
        "http://127.0.0.1@example.com/",  # the host is example.com
        "file:///etc/passwd",
        "ftp://127.0.0.1/",
    ],
)
def test_hosts_and_tricks_not_on_the_list_are_refused(server, url):
    port = server.rsplit(":", 1)[1]
    with pytest.raises(Refused):
        HttpEgress(["127.0.0.1"]).get(url.format(port=port))


def test_a_wildcard_matches_subdomains_only():
    egress = HttpEgress(["*.example.com"])
    with pytest.raises(Refused, match="not on the egress"):
        egress.get("http://example.com.evil.org/")
    with pytest.raises(Refused, match="not on the egress"):
        egress.get("http://notexample.com/")


def test_a_named_host_that_resolves_to_loopback_is_refused(server):
    port = server.rsplit(":", 1)[1]
    with pytest.raises(Refused, match="non-public address"):
        HttpEgress(["localhost"]).get(f"http://localhost:{port}/")
    got = HttpEgress(["localhost"], allow_private_addresses=True).get(f"http://localhost:{port}/x")
    assert got.status == 200


def test_a_closed_port_is_a_failure_not_an_exception():
    got = HttpEgress(["127.0.0.1"], timeout_s=2).get("http://127.0.0.1:9/")
    assert got.status == 0 and got.failure is not None


def test_bad_allow_list_entries_are_misuse():
    with pytest.raises(ValueError, match="allowed hosts"):
        HttpEgress(["http://example.com/"])
