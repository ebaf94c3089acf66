"""Condition types and reasons the operator writes (metav1.Condition vocabulary)."""

from __future__ import annotations

from typing import Final

# --- types -----------------------------------------------------------------------------------
CREATED: Final = "Created"            # children (service, rendezvous store, workers) exist
RUNNING: Final = "Running"            # at least minReplicas workers are running the trainer
RESTARTING: Final = "Restarting"      # the job is below minReplicas and replacing workers
SUSPENDED: Final = "Suspended"        # spec.suspend is true and no worker runs
SUCCEEDED: Final = "Succeeded"        # every worker's trainer finished (terminal)
FAILED: Final = "Failed"              # the job gave up (terminal)
VALID: Final = "Valid"                # the spec passed the reconcile-time checks
ALL_WORKERS_RUNNING: Final = "AllWorkersRunning"  # every desired worker runs (none pending)
CHECKPOINTS_FAILING: Final = "CheckpointsFailing"  # the trainers' latest checkpoint saves failed
HUNG: Final = "Hung"                  # no training step completed for spec.hangTimeoutSeconds
CHECKPOINT_FALLBACK: Final = "CheckpointFallback"  # a resume skipped a damaged checkpoint (sticky)
RENDEZVOUS_STORE_READY: Final = "RendezvousStoreReady"  # the rendezvous store pod is Ready
NODE_DISRUPTION_NOTICE: Final = "NodeDisruptionNotice"  # a worker's node gave notice (a move)
ADMITTED: Final = "Admitted"          # Kueue admitted the job's Workload (Kueue jobs only)
EXPERIMENTAL: Final = "Experimental"  # part of how the job runs is not verified (jobs so run)

# --- reasons ---------------------------------------------------------------------------------
QUEUED: Final = "Queued"                               # waiting in a Kueue LocalQueue for quota
ADMITTED_BY_KUEUE: Final = "AdmittedByKueue"           # the Workload is admitted: pods may run
EVICTED_BY_KUEUE: Final = "EvictedByKueue"             # Kueue took the quota back: save, stop
QUOTA_RELEASED: Final = "QuotaReleased"                # the pods are gone; Kueue has the quota
GROWING_BY_SLICE: Final = "GrowingBySlice"  # a Workload slice asks Kueue for the rest
YIELDED_QUOTA: Final = "YieldedQuota"  # workers given back to a more urgent Workload waiting
KUEUE_NOT_SERVED: Final = "KueueNotServed"             # a queue is named but no Kueue API runs
PODS_GATED: Final = "PodsGatedByKueue"                 # Kueue's pod integration gates our pods
WORKLOAD_CREATED: Final = "WorkloadCreated"            # the job's Kueue Workload was created
JOB_CREATED: Final = "JobCreated"                      # children created for the first time
WORKERS_RUNNING: Final = "WorkersRunning"              # >= minReplicas workers running
WORKERS_PENDING: Final = "WorkersPending"              # waiting for workers to be scheduled
BELOW_MIN_REPLICAS: Final = "BelowMinReplicas"         # fewer than minReplicas workers alive
WORKER_PREEMPTED: Final = "WorkerPreempted"            # a worker was lost to a disruption
WORKER_FAILED: Final = "WorkerFailed"                  # a worker exited non-zero on its own
BACKOFF: Final = "Backoff"                             # waiting before replacing a failed worker
JOB_SUSPENDED: Final = "JobSuspended"                  # spec.suspend set; workers deleted
JOB_RESUMED: Final = "JobResumed"                      # spec.suspend cleared; workers recreated
ALL_WORKERS_SUCCEEDED: Final = "AllWorkersSucceeded"   # every worker exited 0 after training
MAX_RESTARTS_EXCEEDED: Final = "MaxRestartsExceeded"   # restarts > restartPolicy.maxRestarts
MAX_PREEMPTIONS_EXCEEDED: Final = "MaxPreemptionsExceeded"  # preemptions > maxPreemptions
DEADLINE_EXCEEDED: Final = "DeadlineExceeded"          # activeDeadlineSeconds elapsed
CONFIGURATION_ERROR: Final = "ConfigurationError"      # a worker hit an error no restart fixes
INVALID_SPEC: Final = "InvalidSpec"                    # spec failed a reconcile-time check
SPEC_VALID: Final = "SpecValid"                        # spec passed every check
WORKERS_STARTING: Final = "WorkersStarting"            # fewer than minReplicas ever ran so far
JOB_FINISHING: Final = "JobFinishing"                  # a worker finished; waiting for the rest
RECOVERED: Final = "Recovered"                         # back to the desired size after a loss
TRAINING_RESUMED: Final = "TrainingResumed"            # first training step after a loss's resume
SCALED: Final = "Scaled"                               # spec.replicas changed
IN_PROCESS_ON_GPU: Final = "InProcessOnGPU"            # NCCL abort + re-init, unverified
VERIFIED: Final = "Verified"                           # no longer run in an unverified way
NOT_RUNNING: Final = "NotRunning"                      # the job is not running (any cause)
NOT_SUSPENDED: Final = "NotSuspended"                  # spec.suspend is false
NOT_RESTARTING: Final = "NotRestarting"                # no worker is being replaced
JOB_TERMINATED: Final = "JobTerminated"                # the job finished; no worker is kept
CREATE_FAILED: Final = "CreateFailed"                  # the apiserver refused a child object
CHECKPOINT_SAVE_FAILED: Final = "CheckpointSaveFailed"  # consecutive checkpoint saves failed
CHECKPOINTS_HEALTHY: Final = "CheckpointsHealthy"      # the latest checkpoint save committed
NO_TRAINING_PROGRESS: Final = "NoTrainingProgress"     # no step for spec.hangTimeoutSeconds
TRAINING_PROGRESSING: Final = "TrainingProgressing"    # steps complete (or the watchdog is off)
WORKER_CRASHED: Final = "WorkerCrashed"                # the trainer raised (the job's own error)
WORKER_CRASHED_AFTER_FINISH: Final = "WorkerCrashedAfterFinish"  # died once all had finished
DAMAGED_CHECKPOINT_SKIPPED: Final = "DamagedCheckpointSkipped"  # resumed from an older one
STORE_READY: Final = "StoreReady"                      # the store pod is Ready
STORE_STARTING: Final = "StoreStarting"                # created, scheduled or starting; no error
STORE_IMAGE_PULL_FAILED: Final = "StoreImagePullFailed"  # ErrImagePull, ImagePullBackOff, ...
STORE_CRASH_LOOPING: Final = "StoreCrashLooping"       # its container exits and is restarted
STORE_UNSCHEDULABLE: Final = "StoreUnschedulable"      # the scheduler finds no node for it
STORE_CONTAINER_FAILED: Final = "StoreContainerFailed"  # the kubelet cannot create/start it
STORE_LOST: Final = "StoreLost"                        # the store pod ended or goes; replaced
WAITING_FOR_STORE: Final = "WaitingForRendezvousStore"  # a worker lost to a never-Ready store
RENDEZVOUS_STORE_NOT_READY: Final = "RendezvousStoreNotReady"  # never Ready in readyTimeout
MOVING_WORKERS: Final = "MovingWorkers"                # workers move off nodes that gave notice
NO_MOVE: Final = "NoMove"                              # no worker is moving
NOTICES_OFF: Final = "NoticesOff"                      # the operator may not read nodes
