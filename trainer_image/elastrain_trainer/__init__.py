"""elastrain trainer."""
