"""Settings that cannot do what they say on the device the job asks for: warnings, not errors.

The CRD cannot see them as wrong (each field is valid alone, and a custom image may do what the
built-in trainer does not), so `elastrain validate` prints them before a GPU job queues for an
hour and then fails, or a CPU job runs slower than it needs to.
"""

from __future__ import annotations

from elastrain_operator.model.spec import TrainingJobSpec
from elastrain_operator.render.security import shm_size


def device_warnings(spec: TrainingJobSpec) -> list[str]:
    gpus = spec.gpu_count
    out: list[str] = []
    builtin = spec.command is None  # trainer.* settings reach the built-in trainer only
    if builtin and not gpus:
        if spec.trainer.cpu_offload:
            out.append("spec.trainer.cpuOffload has no effect without a GPU in spec.resources "
                       "(the parameters already live in host memory)")
        if spec.trainer.precision == "fp16":
            out.append("spec.trainer.precision fp16 on CPU workers: CPU autocast has few float16 "
                       "kernels and a loss scaler to pay for; use bf16 or fp32 on CPU")
    if gpus:
        nproc = spec.nproc_per_node
        if isinstance(nproc, int) and nproc > gpus:
            out.append(f"spec.nprocPerNode {nproc} is more than the pod's {gpus} GPU(s): NCCL "
                       "refuses two ranks on one GPU; leave nprocPerNode unset (one per GPU)")
        elif isinstance(nproc, int) and nproc < gpus:
            out.append(f"spec.nprocPerNode {nproc} leaves {gpus - nproc} of the pod's {gpus} "
                       "GPU(s) idle; leave nprocPerNode unset (one per GPU)")
        if shm_size(spec) is None:
            out.append("spec.template.shmSize 0 leaves GPU workers the runtime's 64 MiB /dev/shm: "
                       "NCCL's shared-memory transport and DataLoader workers fail with bus errors")
    return out
