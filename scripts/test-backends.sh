#!/usr/bin/env bash
# Installs what the tests drive beyond Python packages, only where it is missing: Chromium
# (and its driver) from the Debian packages, for the viewer's browser tests. Idempotent.
set -euo pipefail

if [ ! -x /usr/bin/chromium ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "test-backends: /usr/bin/chromium is missing; install it as root:" \
            "apt-get install -y chromium chromium-driver" >&2
        exit 1
    fi
    echo "test-backends: installing chromium from the Debian packages" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
fi
