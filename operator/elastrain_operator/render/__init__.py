"""Pure renderers: typed models in, Kubernetes manifests (plain dicts) out."""
