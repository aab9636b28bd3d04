"""The MetaService: key -> location map, per-segment allocation, LRU eviction, leases, membership."""
