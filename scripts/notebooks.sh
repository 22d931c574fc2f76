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
FLAGS=(--notebook-dir=notebooks --ip=127.0.0.1)
if [ "$(uname)" != Darwin ] && [ -z "${DISPLAY:-}" ] && [ -z "${WAYLAND_DISPLAY:-}" ]; then
  FLAGS+=(--no-browser)  # nothing to open a browser on
fi
if [ "$(id -u)" = 0 ]; then
  FLAGS+=(--allow-root)  # containers and cloud machines often run as root; Jupyter refuses without it
fi
echo "Starting JupyterLab on notebooks/ (Ctrl-C to stop). Open the http://127.0.0.1:.../lab?token=... URL it prints."
exec "$VPY" -m jupyter lab "${FLAGS[@]}" "$@"
