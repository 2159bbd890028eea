"""What every node process shares: its loop, the colocated role, and its command-line flags."""
