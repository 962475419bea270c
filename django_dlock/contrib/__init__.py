"""Optional integrations: each module needs its own extra installed."""
