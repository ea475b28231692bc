"""The comparative benchmark suite (``make bench``)."""
