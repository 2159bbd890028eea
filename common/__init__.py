"""pdserve common package."""
