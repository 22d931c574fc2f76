#!/usr/bin/env bash
# Install JupyterLab into .venv (the `notebooks` extra, once) and start it on notebooks/.
# The notebooks' kernel is this .venv's Python, so `import minivllm` is the checkout's code.
# Headless machines: no browser is opened; open the printed http://127.0.0.1:PORT/lab?token=... URL
# (over SSH: `ssh -L PORT:127.0.0.1:PORT host` first). Extra arguments go to `jupyter lab`.
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=.venv/bin/python
if ! "$VPY" -c "import jupyterlab, nbclient, ipykernel, matplotlib" 2>/dev/null; then
  "$VPY" -m pip install -q -e ".[dev,notebooks]"
fi
BROWSER_FLAG=()
if [ "$(uname)" != Darwin ] && [ -z "${DISPLAY:-}" ] && [ -z "${WAYLAND_DISPLAY:-}" ]; then
  BROWSER_FLAG=(--no-browser)
fi
echo "Starting JupyterLab on notebooks/ (Ctrl-C to stop). Open the URL it prints below."
exec "$VPY" -m jupyter lab --notebook-dir=notebooks --ip=127.0.0.1 ${BROWSER_FLAG[@]+"${BROWSER_FLAG[@]}"} "$@"
