"""Pure policies: planning, failure classification, budgets, status, time limits."""
