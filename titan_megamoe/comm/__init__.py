"""Expert-parallel communication: the per-process symmetric workspace and the peers it is shared with."""
