"""Programs: typed keys, the builder that writes them from the pieces, buckets, and the compiled set."""
