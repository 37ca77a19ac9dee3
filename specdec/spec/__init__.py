"""Speculation: proposers, draft trees, acceptance and metrics.
The engine already runs every step as "verify an empty draft"; see docs/DESIGN.md."""
