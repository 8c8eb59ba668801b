"""``kvproto bench``: benchmarks that print ratios against a reference measured in the same run."""
