"""pdserve prefill_node package."""
