"""The only package that talks to the Kubernetes API (the one adapter per side effect)."""
