#!/usr/bin/env bash
# Idempotent setup: Debian packages (bcc, kernel headers, iproute2, openssl for the job certificate),
# the headers linked where bcc looks, and the project's virtualenv at .venv (every extra, pinned by
# constraints.txt) with bcc made importable from it. Every step checks first, so a second run costs
# about a second.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf 'setup: %s\n' "$*" >&2; }

APT_PACKAGES=(python3-bpfcc linux-headers-amd64 iproute2 bpfcc-tools openssl)

apt_missing() {
    local p missing=()
    for p in "${APT_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    echo "${missing[@]:-}"
}

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    missing=$(apt_missing)
    if [ -n "$missing" ]; then
        log "installing Debian packages: $missing"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -q >/dev/null
        # shellcheck disable=SC2086
        apt-get install -y -q --no-install-recommends $missing >/dev/null
    fi
    # bcc compiles against /lib/modules/$(uname -r)/{build,source}. This kernel ships no headers;
    # Debian's generic ones serve the programs in bpf/ (they use only stable UAPI and helpers).
    kdir=/lib/modules/$(uname -r)
    if [ ! -e "$kdir/build/include" ]; then
        hdr=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n 1 || true)
        common=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -n 1 || true)
        if [ -n "$hdr" ] && [ -n "$common" ]; then
            log "linking kernel headers $hdr into $kdir"
            mkdir -p "$kdir"
            ln -sfn "$hdr" "$kdir/build"
            ln -sfn "$common" "$kdir/source"
        else
            log "warning: no Debian kernel headers found; XDP programs will not load"
        fi
    fi
else
    log "not root or no apt-get: skipping Debian packages (XDP and emulation need root)"
fi

PY=${NETSTORM_PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
    log "creating .venv with $PY"
    "$PY" -m venv .venv
fi

stamp_now=$(cat pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)
stamp_file=.venv/.netstorm-setup
if [ "$(cat "$stamp_file" 2>/dev/null || true)" != "$stamp_now" ]; then
    log "installing the project and its dependencies into .venv"
    .venv/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
    # The CPU build of torch lies on this machine's disk; asking for exactly that version keeps pip
    # from fetching a multi-GB CUDA build.
    if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
        .venv/bin/pip install -q 'torch==2.13.0' \
            || log "warning: torch 2.13.0 not installable here; the gloo baseline and the PyTorch example will be unavailable"
    fi
    # Every extra (a node alone needs none: pip install netstorm), at the versions constraints.txt pins
    # (scripts/constraints.py writes it); torch is the step above.
    # diloco (scikit-learn's bundled digits for the real-data trainers) and peers (torchft, whose wheel
    # requires torch>=2.7) name torch too, so they are asked for only when torch is in place: a host
    # without torch keeps every other extra, and constraints.txt's torch pin keeps pip from replacing the
    # CPU build with another.
    extras=scheduler,emulate,dev
    if .venv/bin/python -c 'import torch' 2>/dev/null; then extras=$extras,diloco,peers; fi
    .venv/bin/pip install -q -c constraints.txt -e ".[$extras]"
    echo "$stamp_now" > "$stamp_file"
fi

# bcc is Debian's (python3-bpfcc); make exactly that package importable from the venv.
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ -d /usr/lib/python3/dist-packages/bcc ] && [ ! -e "$site/bcc" ]; then
    ln -sfn /usr/lib/python3/dist-packages/bcc "$site/bcc"
fi
