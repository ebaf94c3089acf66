"""How long a job's pods stay bound to a node that stopped answering (issue 34, item 4).

When a node goes NotReady or unreachable, the node controller taints it
`node.kubernetes.io/not-ready` or `.../unreachable` (NoExecute), and the taint manager evicts each
pod once its toleration of that taint runs out. A pod that names no such toleration gets 300 s
from the DefaultTolerationSeconds admission plugin: five minutes during which a worker, or the
job's store, holds its place on a dead node and nothing replaces it. Every pod of a job names
both, with `spec.recovery.nodeLossTolerationSeconds` (default 30 s: a kubelet restart or a short
control-plane hiccup is ridden out, a lost node is not waited on). A toleration the user wrote
for the same key wins.
"""

from __future__ import annotations

from elastrain_operator.model.spec import TrainingJob
from elastrain_operator.render.meta import Manifest

NODE_LOSS_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")


def with_node_loss_tolerations(job: TrainingJob, tolerations: list[Manifest]) -> list[Manifest]:
    """`tolerations` plus one NoExecute toleration of each node-loss taint it does not name."""
    seconds = job.spec.recovery.node_loss_toleration_seconds
    named = {t.get("key") for t in tolerations}
    return [*tolerations, *({"key": key, "operator": "Exists", "effect": "NoExecute",
                             "tolerationSeconds": seconds}
                            for key in NODE_LOSS_TAINTS if key not in named)]
