"""The Session's parts; elastrain_trainer.api (the Session itself) is what scripts import.

process: the process groups, the script's all_reduce, how a worker process ends; state: what
a Session checkpoints by name; world: what happens when the world changes."""
