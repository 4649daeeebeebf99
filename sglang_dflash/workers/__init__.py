"""workers package."""
