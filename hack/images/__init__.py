"""The project's container images, built here without Docker and without a registry, each cached
as a docker-archive under $ELASTRAIN_CACHE/images named by the hash of its inputs:

    from hack.images import ensure_images
    images = ensure_images(("pause", "operator", "trainer"))   # {name: Image(ref, archive, ...)}
    # ctr -n k8s.io images import images["trainer"].archive; then a pod's `image: <ref>` with
    # imagePullPolicy Never/IfNotPresent

CLI (from the repository root): `python3 -m hack.images build [pause|base|operator|trainer|all]`,
`python3 -m hack.images show`. Standard library only; hack/ is a namespace, not a package, so the
repository root must be on sys.path (it is, for `python3 -m` from there).
"""

from hack.images.cache import BuildError
from hack.images.ensure import DEFAULT_NAMES, NAMES, Image, ensure_images, planned_images

__all__ = ["DEFAULT_NAMES", "NAMES", "BuildError", "Image", "ensure_images", "planned_images"]
