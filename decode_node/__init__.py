"""pdserve decode_node package."""
