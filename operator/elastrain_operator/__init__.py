"""elastrain."""
