"""How the report's tests and benchmark start headless Chromium (Debian's, installed by .ci/run):
no sandbox (containers), no GPU, and nothing that reaches the network on its own, so a request
seen while a report loads is the report's."""

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
