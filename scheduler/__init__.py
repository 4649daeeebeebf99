"""scheduler package."""
