"""The TrainingJob API, typed once: these models generate the CRD and parse every object."""

from elastrain_operator.model.spec import (
    API_GROUP,
    API_VERSION,
    KIND,
    PLURAL,
    TrainingJob,
    TrainingJobSpec,
)
from elastrain_operator.model.status import TrainingJobStatus

__all__ = [
    "API_GROUP",
    "API_VERSION",
    "KIND",
    "PLURAL",
    "TrainingJob",
    "TrainingJobSpec",
    "TrainingJobStatus",
]
