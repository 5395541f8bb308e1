"""rlfw: RL post-training for LLMs whose data-parallel replicas survive failures."""

import os

# Ray reads this once, when it is first imported: without it Ray "resolves" 127.0.0.1 to the machine's external
# address and binds its daemons there. rlfw keeps everything on loopback unless cluster.host says otherwise.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
