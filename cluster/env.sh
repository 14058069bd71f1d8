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

# Ray token auth: <placeholder: the issue that turns RAY_AUTH_MODE=token on for cluster files fills
# this in>. It will read: export RAY_AUTH_MODE=token; export RAY_AUTH_TOKEN_PATH="$HOME/.specdec/ray-token"
# (the token file shipped to every node by a `file_mounts` entry of the cluster file). Until then
# ~/.specdec/env can set both on each node (tests/e2e/test_ray_up.py does).
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"

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
