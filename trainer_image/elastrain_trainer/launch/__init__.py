"""The launcher family: how elastrain starts torchrun agents and keeps them going.

    python -m elastrain_trainer.launch [torchrun options] -m elastrain_trainer   (__main__.py)

- agent.py: the patches to torchrun's elastic agent (a restart waits like a stop; a worker's
  own crash ends the node with a one-line reason instead of restarting it in place);
- rdzv_store.py: the standalone rendezvous store program (the operator holds a copy);
- cluster.py: a store and N torchrun agents as processes on this machine (LocalCluster);
- supervise.py: local mode's restartPolicy: count each agent's end, replace it or give up;
- local.py: `elastrain run --local` (run_local, worker_entry).

Imports only go down local -> supervise -> cluster -> rdzv_store, and nothing here imports the
training code (pyproject.toml's import-linter contracts). This module imports nothing, so that
`python -m elastrain_trainer.launch` loads no more than the launcher needs.
"""
