# The environment of every command Ray runs on a specdec cluster node.
#
# Setup appends `. ~/specdec/cluster/env.sh` to ~/.bashrc, and Ray runs each command of `ray up`,
# `ray exec`, `ray attach` and `ray down` (its `ray stop`) in a login shell that sources ~/.bashrc,
# so they all find the venv's `ray` and `specdec` and run with the same settings.
# cluster/service.sh sources this file itself.

export PATH="$HOME/specdec/.venv/bin:$PATH"

# Packs are prepared at setup; serving never fetches anything.
export HF_HUB_OFFLINE=1
export TOKENIZERS_PARALLELISM=false

# Ray token auth, on: every Ray process (`ray start`, the autoscaler), `specdec serve`, `ray status`
# and whatever `ray exec` runs present the deployment's token. The operator makes it once and the
# cluster file's file_mounts ship it to every node as ~/.specdec/ray-token (cluster/README.md, "Ray
# token auth"). RAY_AUTH_TOKEN, if set, would win over the file: nothing here sets it.
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH="$HOME/.specdec/ray-token"

# The address this node was reached at over SSH: for the local provider, its entry in head_ip /
# worker_ips. The local cluster file starts Ray with it (--node-ip-address) and picks the node's
# resources by it.
if [ -n "${SSH_CONNECTION:-}" ]; then
    SPECDEC_NODE_IP="$(echo "$SSH_CONNECTION" | cut -d' ' -f3)"
    export SPECDEC_NODE_IP
fi

# Per-node settings, last so they win (SPECDEC_CACHE, CUDA_VISIBLE_DEVICES, NCCL_SOCKET_IFNAME, ...).
if [ -f "$HOME/.specdec/env" ]; then
    . "$HOME/.specdec/env"
fi
