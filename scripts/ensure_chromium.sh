#!/usr/bin/env bash
# Best effort: install Debian's chromium so the report test (tests/test_report_html.py) can open index.html
# headless. Idempotent and quiet; never fails the build (the test skips with a reason when it is absent).
command -v chromium >/dev/null 2>&1 && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; } \
        >/dev/null 2>&1 || echo "ensure_chromium: could not install chromium; the HTML render test will be skipped" >&2
fi
exit 0
