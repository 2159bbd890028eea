"""pdserve kv_transfer package."""
