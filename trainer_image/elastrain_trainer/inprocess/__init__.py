"""In-process recovery (docs/recovery.md, issue 21): survivors keep their processes, model and
optimizer; the process group is re-formed around them at a step boundary, and a joiner receives
the state from a live peer.

    membership  pure: store key names, the plan of a generation change, liveness
    store       the adapter over the job's TCPStore (the keys of membership)
    regroup     destroy the default group, init the next generation's on its own store prefix
    transfer    a joiner's state from a live peer (point to point, checksummed)
    rewrap      DDP at the new world, in place
    heartbeat   a thread: this node's beat, watched peers' liveness, the generation's failure key
    member      one node's side of the protocol, tying the above together at step boundaries
    config      ELASTRAIN_RECOVERY=inProcess and its settings, from the environment
    session     what the Session API (api.py) needs: LiveDistEnv, join, settle
"""
